"""Gradient compression against torch's PowerSGD hook: bytes per step and step time, same run.

    python benchmarks/compression.py [--world-size 2] [--steps 8] [--model small] [--rank 4] [--markdown FILE]

(`--markdown lessons/figures/10-benchmark.txt` also writes the table that lesson 10 includes.)

On the same rank processes and the same batches it times one training step (forward,
backward with gradient communication, AdamW step) of each of these, round robin in a shuffled
order each round (`tinyscale.bench.round_robin(shuffle=0)`: each follows every other about
equally often, since a step placed right after a slow one reads slower):

    torch DDP                      no hook: the uncompressed all-reduce
    torch DDP + torch PowerSGD     torch's own `powerSGD_hook`, rank --rank
    torch DDP + our PowerSGD       tinyscale.compression.powersgd_hook on torch's DDP
    BucketedDDP                    ours, uncompressed
    BucketedDDP + <compressor>     top-k 1%, random-k 1%, max-norm 8 and 4 bits (error feedback on),
                                   our PowerSGD (compression_hook / powersgd_hook)
    1-bit Adam                     the optimizer communicates (freeze step 2, so most steps are 1-bit)

and reports the median step time, its ratio to torch's PowerSGD, and the bytes per
compressed step. Our collectives go through the comm ledger, so their bytes are measured;
torch's DDP calls torch.distributed directly, past our ledger, so its bytes are computed:
the full gradient for plain DDP, and PowerSGD's payload formula (`payload_elements`, the same
specification) for its hook. The ledger's 'size' convention counts an all-gather's output,
so a gathered payload shows N times one rank's payload (lesson 10 explains why).

On CPU ranks over gloo the gradients are small and compute dominates: the step times show the
compressors' own cost (top-k's selection, QSGD's rounding), not the bandwidth they save. A
2-rank CPU run cannot show the throughput gains the papers report on real networks.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

import tinyscale as ts
from tinyscale.bench import add_json_argument, round_robin, slowest, write_json
from tinyscale.compression import (
    QSGD, CompressionState, OneBitAdam, PowerSGDState, RandomK, TopK, compression_hook, powersgd_hook,
)
from tinyscale.compression.powersgd import payload_elements
from tinyscale.data import local_micro_batches, sample_batches, stdlib_corpus
from tinyscale.data_parallel import BucketedDDP
from tinyscale.dist import comm
from tinyscale.models import GPT, GPTConfig

TORCH_PSGD = "torch DDP + torch PowerSGD"


def _variants(rank: int) -> dict:
    """name -> (wrap(model) -> (module, hook state or None), uses 1-bit Adam)."""
    def ours(hook, make_state):
        def wrap(m):
            ddp = BucketedDDP(m)
            state = make_state()
            ddp.register_comm_hook(state, hook)
            return ddp, state
        return wrap

    def torch_ddp(hook=None, make_state=None):
        def wrap(m):
            ddp = torch.nn.parallel.DistributedDataParallel(m)
            state = None
            if hook is not None:
                state = make_state()
                ddp.register_comm_hook(state, hook)
            return ddp, state
        return wrap

    return {
        "torch DDP": torch_ddp(),
        TORCH_PSGD: torch_ddp(torch_psgd.powerSGD_hook,
                              lambda: torch_psgd.PowerSGDState(None, matrix_approximation_rank=rank,
                                                               start_powerSGD_iter=2)),
        "torch DDP + our PowerSGD": torch_ddp(powersgd_hook, lambda: PowerSGDState(
            None, matrix_approximation_rank=rank, start_powerSGD_iter=2)),
        "BucketedDDP": lambda m: (BucketedDDP(m), None),
        "BucketedDDP + top-k 1%": ours(compression_hook, lambda: CompressionState(TopK(0.01))),
        "BucketedDDP + random-k 1%": ours(compression_hook, lambda: CompressionState(RandomK(0.01))),
        "BucketedDDP + max-norm 8-bit": ours(compression_hook, lambda: CompressionState(QSGD(8, norm="max"))),
        "BucketedDDP + max-norm 4-bit": ours(compression_hook, lambda: CompressionState(QSGD(4, norm="max"))),
        "BucketedDDP + our PowerSGD": ours(powersgd_hook, lambda: PowerSGDState(
            None, matrix_approximation_rank=rank, start_powerSGD_iter=2)),
        "1-bit Adam (no DDP)": None,
    }


def _bench_rank(model_name: str, steps: int, micro: int, rank: int) -> dict:
    cfg = GPTConfig.preset(model_name)
    world, me = dist.get_world_size(), dist.get_rank()
    batches = sample_batches(stdlib_corpus("train").tokens, num_batches=steps + 2, batch_size=micro * world,
                             seq_len=cfg.max_seq_len, seed=0)
    runs = {}
    for name, wrap in _variants(rank).items():
        model = GPT(cfg, seed=0)
        if wrap is None:  # 1-bit Adam owns the communication: no DDP wrapper
            module, state, opt = model, None, OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2)
        else:
            (module, state), opt = wrap(model), torch.optim.AdamW(model.parameters(), lr=1e-3)
        runs[name] = {"model": model, "module": module, "state": state, "opt": opt, "times": [], "bytes": 0}
    # The first two rounds are the plain all-reduce of PowerSGD (start_iter 2) and 1-bit Adam's
    # warm-up: dropped, so the timed median and the bytes are over the later, compressed steps.
    def step(run, i):
        (local,) = local_micro_batches(batches[i], dp_rank=me, dp_size=world, micro_batch_size=micro)
        with comm.record() as ledger:
            run["module"](*local).backward()
            run["opt"].step()
            run["opt"].zero_grad(set_to_none=True)
        run["bytes"] = sum(r.bytes for r in ledger.rows)

    times = round_robin({name: lambda i, run=run: step(run, i) for name, run in runs.items()}, steps, warmup=2,
                        before=dist.barrier, shuffle=0)
    out = {}
    for name, run in runs.items():
        nbytes = run["bytes"]
        if name.startswith("torch DDP") and name != "torch DDP + our PowerSGD":  # past our ledger: computed
            params = [p for p in run["model"].parameters() if p.requires_grad]
            itemsize = params[0].element_size()
            if name == TORCH_PSGD:  # one bucket of every matrix (torch's 25 MiB bucket holds this model)
                same_settings = PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
                plain, ps, qs = payload_elements([tuple(p.shape) for p in params], same_settings)
                nbytes = (plain + ps + qs) * itemsize
            else:
                nbytes = sum(p.numel() for p in params) * itemsize
        out[name] = {"times": times[name], "bytes": nbytes}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--model", default="small", choices=["tiny", "small"])
    parser.add_argument("--micro", type=int, default=4, help="rows per rank per step")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD's matrix_approximation_rank")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as markdown to FILE")
    add_json_argument(parser)
    args = parser.parse_args()
    console = Console()
    with console.status(f"{args.world_size} ranks..."):
        per_rank = ts.dist.launch(_bench_rank, args.world_size, args.model, args.steps, args.micro, args.rank,
                                  timeout_s=3600)
    r = per_rank[0]
    for name, v in r.items():  # a step ends when every rank's does
        v["s"] = statistics.median(slowest([rank_result[name]["times"] for rank_result in per_rank]))
    base_s, base_bytes = r[TORCH_PSGD]["s"], r["torch DDP"]["bytes"]
    columns = ("variant", "ms/step", "vs torch PowerSGD", "bytes/step", "vs uncompressed", "bytes from")
    rows = [(name, f"{v['s'] * 1e3:.1f}", f"{v['s'] / base_s:.2f}x", f"{v['bytes']:,}",
             f"{v['bytes'] / base_bytes:.3f}", "formula" if name in ("torch DDP", TORCH_PSGD) else "ledger")
            for name, v in r.items()]
    title = (f"{args.world_size} ranks ({ts.dist.resolve_backend('auto', args.world_size)}): {args.model} GPT, "
             f"{args.micro} rows/rank, median of {args.steps} compressed steps")
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    machine = (f"{os.cpu_count()} CPU cores, torch {torch.__version__}, "
               f"{'CUDA ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU only'}, "
               f"load average {os.getloadavg()[0]:.1f}")
    console.print(f"machine: {machine}. Ledger bytes of BucketedDDP include its small usage-flag all-reduce; "
                  "an all-gather counts N payloads. Step times on shared CPU cores are load-dependent.")
    if args.markdown:
        lines = [f"Machine: {machine}; run {datetime.date.today()}. {title}.", "",
                 "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    write_json(args.json, {"compression_bucketed_vs_torch_ddp": r["BucketedDDP"]["s"] / r["torch DDP"]["s"],
                           "compression_our_powersgd_vs_torch_powersgd": r["BucketedDDP + our PowerSGD"]["s"] / base_s},
               model=args.model, world_size=args.world_size, steps=args.steps)


if __name__ == "__main__":
    main()
