"""The engine's data parallelism (BucketedDDP inside) against torch's DistributedDataParallel, same run.

    python benchmarks/engine_ddp.py [--world-sizes 2 4] [--steps 8] [--model small]

Both train the same GPT on the same batches in the same rank processes; the table shows
the median step time of each and their ratio, plus the bytes each all-reduces per step.
The engine's step adds to plain DDP what a real trainer does: micro-batching, an
all-reduce of the loss for reporting, gradient clipping and the LR schedule.
`benchmarks/ddp.py` compares the data-parallel wrappers alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import tinyscale as ts
from tinyscale.bench import add_json_argument, write_json
from tinyscale.data import local_micro_batches, sample_batches, stdlib_corpus
from tinyscale.models import GPT, GPTConfig


def _bench_rank(model_name: str, steps: int, micro: int) -> dict:
    cfg = GPTConfig.preset(model_name)
    world = dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": micro, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    batches = sample_batches(stdlib_corpus("train").tokens, num_batches=steps + 1, batch_size=micro * world,
                             seq_len=cfg.max_seq_len, seed=0)
    out = {}

    # ours
    engine = ts.initialize(GPT(cfg, seed=0), config)
    times = []
    for batch in batches:
        dist.barrier()
        start = time.perf_counter()
        engine.train_batch(batch)
        times.append(time.perf_counter() - start)
    out["ours_s"] = statistics.median(times[1:])  # the first step pays for warm-up
    out["ours_bytes"] = engine.comm_ledger.bytes("all_reduce") / len(batches)

    # torch DDP on the same rows of the same batches
    model = GPT(cfg, seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for batch in batches:
        (local,) = local_micro_batches(batch, dp_rank=dist.get_rank(), dp_size=world, micro_batch_size=micro)
        dist.barrier()
        start = time.perf_counter()
        ddp(*local).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    out["torch_s"] = statistics.median(times[1:])
    out["torch_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--model", default="small", choices=["tiny", "small"])
    parser.add_argument("--micro", type=int, default=4, help="rows per rank per step")
    add_json_argument(parser)
    args = parser.parse_args()
    console = Console()
    table = Table(title=f"engine vs torch DDP: {args.model} GPT, {args.micro} rows/rank, "
                        f"median of {args.steps} steps")
    for col in ("ranks", "backend", "ours ms/step", "torch DDP ms/step", "ours / torch", "all-reduce bytes/step"):
        table.add_column(col, justify="right")
    ratios = {}
    for world in args.world_sizes:
        with console.status(f"{world} ranks..."):
            r = ts.dist.launch(_bench_rank, world, args.model, args.steps, args.micro, timeout_s=1800)[0]
        ratios[f"engine_ddp_vs_torch_{world}"] = r["ours_s"] / r["torch_s"]
        table.add_row(str(world), ts.dist.resolve_backend("auto", world), f"{r['ours_s'] * 1e3:.1f}",
                      f"{r['torch_s'] * 1e3:.1f}", f"{r['ours_s'] / r['torch_s']:.2f}x",
                      f"{r['ours_bytes']:,.0f} (torch: {r['torch_bytes']:,})")
    console.print(table)
    console.print(f"machine: {torch.get_num_threads()} threads here, torch {torch.__version__}, "
                  f"{'CUDA ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU only'}")
    write_json(args.json, ratios, model=args.model, steps=args.steps)


if __name__ == "__main__":
    main()
