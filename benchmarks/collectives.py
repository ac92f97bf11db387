"""Our all-reduce algorithms against torch.distributed.all_reduce (gloo on CPU, NCCL on GPUs).

    python benchmarks/collectives.py [--world-sizes 2 4] [--max-size 16M] [--repeats 10] [--markdown FILE]

For each world size and message size: the median over repeats of the slowest rank's time
(`tinyscale.collectives.profile`), each algorithm's ratio to torch's own all-reduce, and
torch's and the ring's bus bandwidth (nccl-tests' busbw = size / time * 2(n-1)/n). The
hierarchical all-reduce runs with 2 ranks per "node" where the world size is even.
Timings on a shared machine are noisy: medians help, single ratios within ~20% are ties.
``--markdown lessons/figures/01-benchmark.txt`` also writes the tables, with the machine,
as the markdown that lesson 1 includes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform

import torch
from rich.console import Console
from rich.table import Table

import tinyscale as ts
from tinyscale.bench import add_json_argument, write_json
from tinyscale.collectives import ALL_REDUCE, profile

TORCH = "tinyscale.dist.comm:all_reduce"
HIERARCHICAL = "tinyscale.collectives.hierarchical:hierarchical_all_reduce_world"
SHORT = {"naive": "naive", "ring": "ring", "recursive_halving_doubling": "rec. halving/doubling",
         "recursive_doubling": "rec. doubling", "tree": "tree", "hierarchical": "hier. (2/node)"}


def _bench_rank(algorithms: dict[str, str], sizes: list[int], repeats: int) -> list[dict]:
    return profile(algorithms, sizes, dtype=torch.float32, repeats=repeats)


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _human(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return f"{cpu}, {os.cpu_count()} cores{gpu}, torch {torch.__version__}, {platform.system()}{load}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--min-size", type=_size, default=_size("1K"))
    parser.add_argument("--max-size", type=_size, default=_size("16M"))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--markdown", metavar="FILE", help="also write the tables as markdown to FILE")
    add_json_argument(parser)
    args = parser.parse_args()
    sizes, size = [], args.min_size
    while size <= args.max_size:
        sizes.append(size)
        size *= 4
    console = Console()
    console.print(f"machine: {machine()}")
    markdown = [f"Machine: {machine()}; run {datetime.date.today()}, median of {args.repeats} repeats.", ""]
    for world in args.world_sizes:
        algorithms = {"torch": TORCH, **ALL_REDUCE}
        if world % 2 == 0 and world > 2:
            algorithms["hierarchical"] = HIERARCHICAL
        with console.status(f"{world} ranks, {len(sizes)} sizes, {len(algorithms)} algorithms..."):
            rows = ts.dist.launch(_bench_rank, world, algorithms, sizes, args.repeats, timeout_s=1800)[0]
        backend = ts.dist.resolve_backend("auto", world)
        by = {(r["algorithm"], r["bytes"]): r for r in rows}
        ours = [a for a in algorithms if a != "torch"]
        table = Table(title=f"all-reduce on {world} ranks ({backend}), float32: median ms of {args.repeats} "
                            "(ratio to torch)")
        columns = ["size", "torch ms", *[SHORT[a] for a in ours], "torch busbw GB/s", "ring busbw GB/s"]
        for col in columns:
            table.add_column(col, justify="right")
        markdown += [f"**{world} ranks ({backend})**, ms per all-reduce (ratio to torch):", "",
                     "| " + " | ".join(columns) + " |", "|" + "---:|" * len(columns)]
        for nbytes in sorted({r["bytes"] for r in rows}):
            base = by[("torch", nbytes)]["seconds"]
            cells = [_human(nbytes), f"{base * 1e3:.3f}"]
            cells += [f"{by[(a, nbytes)]['seconds'] * 1e3:.3f} ({by[(a, nbytes)]['seconds'] / base:.2f}x)"
                      for a in ours]
            cells += [f"{by[('torch', nbytes)]['busbw'] / 1e9:.3f}", f"{by[('ring', nbytes)]['busbw'] / 1e9:.3f}"]
            table.add_row(*cells)
            markdown.append("| " + " | ".join(cells) + " |")
        console.print(table)
        markdown.append("")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(markdown))
        console.print(f"wrote {args.markdown}")
    write_json(args.json, {}, tables=markdown)


if __name__ == "__main__":
    main()
