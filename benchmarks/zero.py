"""ZeRO stage 3 against FSDP2 (`fully_shard`), and stages 1 and 2 against DDP: same model, same run.

    python benchmarks/zero.py [--world-size 2] [--model small] [--steps 50] [--micro 4] [--json PATH]
                              [--only "torch DDP,ZeroStage1,ZeroStage2"]

On the same rank processes and the same batches, it times one training step (forward,
backward, AdamW step, gradients zeroed) of each of these, every one on its own float32
copy of the GPT, steps interleaved round-robin so that changes in the machine's load hit
all of them alike, each round in an order of its own (seeded, the same on every rank) so that
no variant always runs right after the same one; the first two steps of each are warm-up and
dropped:

    torch DDP                      replicas, bucketed all-reduce during backward
    torch DDP + ZeroRedundancyOpt  torch's own stage 1
    ZeroStage1, ZeroStage2         tinyscale.zero, with torch DDP's bucket layout (a 1 MiB first
                                   bucket, then 25 MiB): both reduce-scatter during backward
    the same, overlap_param_gather Megatron's option: the step's all-gather left in flight, each
                                   unit waited for by the next forward's first module that reads it
    FSDP2 fully_shard              each transformer block, then the root (the same units as ours)
    FSDP2, async + prefetch        the same, with async all-gathers and explicit forward prefetch
    ZeroStage3                     tinyscale.zero, prefetch on (as the engine runs it)
    ZeroStage3, no prefetch        the same with `prefetch = False`: what prefetch buys

and reports the median step time (and, apart, the median time of what runs after backward,
"optimizer ms": for ZeroStage1, ZeroStage2 and torch's ZeRO-1 the parameter all-gather or
broadcast, for DDP, FSDP2 and ZeroStage3 no communication), the ratio against the reference (stage 3 against FSDP2,
the others against torch DDP; the target for stage 3 is at most 1.3x), the spread
(fastest .. slowest step), and the bytes our implementations put on the wire per step (the
comm ledger's bus bytes, against the 2 Psi and 3 Psi of ZeRO's section 7), recorded on the last
warm-up step: torch's own collectives bypass the ledger, so a row written in a timed step
would be charged to ours alone. Timing: tinyscale.bench (the slowest rank's step).
`--json PATH` writes zero1_vs_ddp, zero2_vs_ddp (the stages as built by default: blocking
all-gather), zero1_overlap_param_gather_vs_ddp, zero2_overlap_param_gather_vs_ddp and
zero3_vs_fsdp2 (each the ratio of the medians) and, under "intervals", each one's 95%
bootstrap interval over the paired rounds
(`tinyscale.bench.ratio_interval`, as benchmarks/ddp.py) and, as KEY_per_round, the median of
each round's ratio with its interval: an interval that holds 1.0 says the run cannot tell the
two apart. The default 50 rounds (10 steps a round, about a second on 2 quiet cores) resolve a
few percent in about a minute; 6 rounds (the earlier default) spread 10 points run to run.
`--only NAMES` (comma-separated variant names) times those alone, and reports the ratios whose
two sides are both among them: "torch DDP,ZeroStage1,ZeroStage2" takes a third of the time.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import tinyscale as ts
from tinyscale.bench import add_json_argument, interval_verdict, ratio_interval, round_robin, slowest, write_json
from tinyscale.data import local_micro_batches, sample_batches, stdlib_corpus
from tinyscale.dist import comm
from tinyscale.models import GPT, GPTConfig
from tinyscale.zero import ZeroStage1, ZeroStage2, ZeroStage3

LR = 1e-3
WARMUP = 2  # rounds dropped; the last of them records the bytes on the wire (comm ledger)
REFERENCE = {"ZeroStage3": "FSDP2 fully_shard", "ZeroStage3, no prefetch": "FSDP2 fully_shard",
             "FSDP2, async + prefetch": "FSDP2 fully_shard"}


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


class _Plain:
    """A torch model with a torch optimizer: step = optimizer step + zero_grad."""

    def __init__(self, forward, optimizer):
        self.forward, self.optimizer = forward, optimizer

    def step(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class _Zero:
    """One of our stages: the model is called as is; the stage's hooks and step do the rest."""

    def __init__(self, model, zero):
        self.forward, self.zero = model, zero

    def step(self):
        self.zero.step()


def _build(name: str, cfg: GPTConfig):
    model = GPT(cfg, seed=0)  # float32; the same initial parameters on every rank
    params = list(model.parameters())
    if name == "torch DDP":
        return _Plain(torch.nn.parallel.DistributedDataParallel(model), _adamw(params))
    if name == "torch DDP + ZeroRedundancyOpt":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return _Plain(torch.nn.parallel.DistributedDataParallel(model),
                      ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=LR))
    if name.startswith(("ZeroStage1", "ZeroStage2")):  # torch DDP's default bucket layout
        stage = ZeroStage1 if name.startswith("ZeroStage1") else ZeroStage2
        overlap = name.endswith("overlap_param_gather")
        return _Zero(model, stage(params, _adamw, bucket_bytes=25 * 2**20, first_bucket_bytes=2**20,
                                  overlap_param_gather=overlap, module=model))
    if name.startswith("FSDP2"):
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:  # the same units as ZeroStage3's default: each block, then the root
            fully_shard(block)
        fully_shard(model)
        if name.endswith("prefetch"):
            # FSDP2's own overlap in forward relies on CUDA streams (the host runs ahead of
            # the GPU); on CPU its all-gathers block. Ask for what ZeroStage3 does: async
            # all-gathers, and each unit prefetching the next (a private switch in torch 2.13).
            if hasattr(model, "_set_unshard_async_op"):  # absent in other torch versions: prefetch only
                model._set_unshard_async_op(True)
            units = [model, *model.blocks]
            for unit, after in itertools.pairwise(units):
                unit.set_modules_to_forward_prefetch([after])
        return _Plain(model, _adamw(model.parameters()))
    if name.startswith("ZeroStage3"):
        zero = ZeroStage3(params, _adamw, module=model)
        zero.prefetch = name == "ZeroStage3"
        return _Zero(model, zero)
    raise ValueError(f"unknown variant {name!r}")


VARIANTS = ("torch DDP", "torch DDP + ZeroRedundancyOpt", "ZeroStage1", "ZeroStage2",
            "ZeroStage1, overlap_param_gather", "ZeroStage2, overlap_param_gather",
            "FSDP2 fully_shard", "FSDP2, async + prefetch", "ZeroStage3", "ZeroStage3, no prefetch")


def _bench_rank(model_name: str, steps: int, micro: int, only: tuple[str, ...] = VARIANTS) -> dict:
    cfg = GPTConfig.preset(model_name)
    world, rank = dist.get_world_size(), dist.get_rank()
    batches = sample_batches(stdlib_corpus("train").tokens, num_batches=steps + WARMUP, batch_size=micro * world,
                             seq_len=cfg.max_seq_len, seed=0)
    runs = {name: {"impl": _build(name, cfg), "step_times": [], "bus_bytes": None} for name in only}

    def step(run, i):
        (local,) = local_micro_batches(batches[i], dp_rank=rank, dp_size=world, micro_batch_size=micro)
        # the ledger on the last warm-up round only: a row costs ours each launch, and torch's none
        with comm.record() if i == WARMUP - 1 else contextlib.nullcontext() as ledger:
            run["impl"].forward(*local).backward()
            backward_done = time.perf_counter()
            run["impl"].step()
        run["step_times"].append(time.perf_counter() - backward_done)
        if ledger is not None:
            run["bus_bytes"] = ledger.bus_bytes() if ledger.rows else None

    # each round in its own order (the same on every rank): what ran just before a step changes
    # its time (lesson 02 measured about 1 ms of 70), so no variant always follows the same one
    times = round_robin({name: lambda i, run=run: step(run, i) for name, run in runs.items()}, steps, warmup=WARMUP,
                        before=dist.barrier, shuffle=0)
    psi = sum(p.numel() for p in GPT(cfg).parameters())
    return {"psi": psi, "world": world,
            "variants": {name: {"times": times[name], "step_times": run["step_times"][WARMUP:],
                                "bus_bytes": run["bus_bytes"]}
                         for name, run in runs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", default="small", choices=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=50, help="timed rounds (each variant one step a round, "
                                                               "after 2 warm-up rounds)")
    parser.add_argument("--micro", type=int, default=4, help="rows per rank per step")
    parser.add_argument("--only", type=lambda s: tuple(v.strip() for v in s.split(",")), default=VARIANTS,
                        help="comma-separated variants to time (default: all): " + ", ".join(VARIANTS))
    add_json_argument(parser)
    args = parser.parse_args()
    unknown = [v for v in args.only if v not in VARIANTS]
    if unknown:
        parser.error(f"--only: unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    if args.world_size < 2:
        parser.error("--world-size must be at least 2 (sharding over one rank compares nothing)")
    console = Console()
    if not console.is_terminal:  # piped into a file: do not squeeze the table into 80 columns
        console = Console(width=150)
    with console.status(f"{args.world_size} ranks, {len(args.only)} variants x {args.steps + 2} steps..."):
        per_rank = ts.dist.launch(_bench_rank, args.world_size, args.model, args.steps, args.micro, args.only,
                                  timeout_s=3600)
    r = per_rank[0]
    for name, v in r["variants"].items():  # a step ends when every rank's does
        v["times"] = slowest([rank_result["variants"][name]["times"] for rank_result in per_rank])
    n, psi = r["world"], r["psi"]
    median = {name: statistics.median(v["times"]) for name, v in r["variants"].items()}
    table = Table(title=f"{n} ranks ({ts.dist.resolve_backend('auto', n)}): {args.model} GPT ({psi:,} params, "
                        f"float32), {args.micro} rows/rank, median of {args.steps} steps")
    for col in ("variant", "ms/step", "(min .. max)", "optimizer ms", "against", "ratio",
                "bus bytes/rank/step", "/ 4 Psi"):
        table.add_column(col, justify="right")
    for name, v in r["variants"].items():
        ref = REFERENCE.get(name, "torch DDP")
        ratio = "" if name == ref or ref not in median else f"{median[name] / median[ref]:.2f}x"
        bus = v["bus_bytes"]
        table.add_row(name, f"{median[name] * 1e3:.1f}",
                      f"({min(v['times']) * 1e3:.0f} .. {max(v['times']) * 1e3:.0f})",
                      f"{statistics.median(v['step_times']) * 1e3:.1f}",
                      "" if name == ref else ref, ratio,
                      "(torch's)" if bus is None else f"{bus:,.0f}",
                      "" if bus is None else f"{bus / (4 * psi):.3f}")
    console.print(table)
    if {"ZeroStage3", "FSDP2 fully_shard", "FSDP2, async + prefetch", "ZeroStage3, no prefetch"} <= median.keys():
        ratio = median["ZeroStage3"] / median["FSDP2 fully_shard"]
        tuned = median["ZeroStage3"] / median["FSDP2, async + prefetch"]
        console.print(f"ZeroStage3 / FSDP2 = {ratio:.2f}x (target <= 1.3x: {'met' if ratio <= 1.3 else 'NOT met'}); "
                      f"against FSDP2 with async all-gathers and forward prefetch {tuned:.2f}x; "
                      f"prefetch saves {(median['ZeroStage3, no prefetch'] - median['ZeroStage3']) * 1e3:.1f} ms/step. "
                      f"Ring formulas: 2(N-1)/N = {2 * (n - 1) / n:.3f}, 3(N-1)/N = {3 * (n - 1) / n:.3f} "
                      "(x 4 B x Psi, plus padding).")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    console.print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, "
                  f"{'CUDA ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU only'}, "
                  f"load average {load}; CPU ranks share the cores for compute and for gloo's communication.")
    pairs = {"zero1_vs_ddp": ("ZeroStage1", "torch DDP"), "zero2_vs_ddp": ("ZeroStage2", "torch DDP"),
             "zero1_overlap_param_gather_vs_ddp": ("ZeroStage1, overlap_param_gather", "torch DDP"),
             "zero2_overlap_param_gather_vs_ddp": ("ZeroStage2, overlap_param_gather", "torch DDP"),
             "zero3_vs_fsdp2": ("ZeroStage3", "FSDP2 fully_shard")}
    ratios, intervals = {}, {}
    for key, (ours, base) in pairs.items():
        if ours not in median or base not in median:  # --only left one side out
            continue
        a, b = r["variants"][ours]["times"], r["variants"][base]["times"]
        ratios[key] = median[ours] / median[base]
        low, high = intervals[key] = ratio_interval(a, b)
        each = statistics.median([x / y for x, y in zip(a, b)])
        each_low, each_high = ratio_interval(a, b, per_round=True)
        intervals[key + "_per_round"] = (each, each_low, each_high)
        verdict = interval_verdict(low, high)
        console.print(f"{key}: {ratios[key]:.3f}x, 95% interval {low:.3f} .. {high:.3f} (bootstrap over "
                      f"{args.steps} paired rounds): {verdict}; the median of each round's ratio {each:.3f}x "
                      f"({each_low:.3f} .. {each_high:.3f})")
    write_json(args.json, ratios, model=args.model, world_size=n, steps=args.steps,
               intervals={k: [round(v, 4) for v in iv] for k, iv in intervals.items()},
               step_ms={name: [round(t * 1e3, 3) for t in v["times"]] for name, v in r["variants"].items()})


if __name__ == "__main__":
    main()
