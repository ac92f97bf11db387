"""NaiveDDP and BucketedDDP against torch's DistributedDataParallel: same model, same run.

    python benchmarks/ddp.py [--world-sizes 2 4] [--steps 30] [--model small] [--bucket-mb 25]
                             [--first-bucket-mb 1] [--small-bucket-mb 0.5] [--json PATH]
                             [--only naive small no-overlap no-sync]

For each world size, on the same rank processes and the same batches, it times one
training step (forward, backward with gradient synchronisation, AdamW step) of:

    torch DDP                  25 MiB buckets, the first 1 MiB (its defaults), overlapped
    NaiveDDP                   one blocking all-reduce per parameter after backward
    BucketedDDP                buckets as torch's: --bucket-mb, the first --first-bucket-mb
    BucketedDDP, small buckets buckets of --small-bucket-mb (9 on the small GPT): what each
                               extra message costs
    BucketedDDP, no overlap    BucketedDDP's buckets, launched only after backward
    no sync                    the same step inside no_sync(): compute alone

(`--only`: torch DDP, BucketedDDP and the rows named, for a shorter A/B run) and reports
medians, ratios against torch DDP, all-reduce bytes and calls per step (from the comm
ledger, on the last warm-up step: torch's collectives bypass the ledger, so a row written in
a timed step would be charged to ours alone), and the fraction of communication time that
overlap hides:

    hidden = (no-overlap step - overlapped step) / (no-overlap step - compute-only step)

Timing: tinyscale.bench (round-robin steps, 2 warm-up rounds dropped, the slowest
rank's step, median and spread); torch DDP and BucketedDDP go first in each round and trade
places every other round, so each follows the same steps as often. `--json PATH` writes
ddp_bucketed_vs_torch_N per world size N (the ratio of the medians) and, under "intervals", its
95% confidence interval.

How sure is a ratio? The steps' spread (min .. max) on 2 shared cores is often wider than the
difference measured, so each ratio comes with a bootstrap interval: the rounds resampled with
replacement (each round's pair of steps kept together, as the round-robin timed them side by
side), the ratio of medians recomputed each time, its 2.5th and 97.5th percentiles. An interval
that holds 1.0 says this run cannot tell BucketedDDP from torch DDP. Beside it, the median of
each round's ratio and its interval (`_per_round` in --json: figure, low, high): a burst of
load that slows a whole round divides out of it, so it is often the narrower. The default 30
steps keep one run around a minute on 2 quiet cores.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import tinyscale as ts
from tinyscale.bench import (add_json_argument, interval_verdict, ratio_interval, round_robin, slowest, summary,
                             write_json)
from tinyscale.data import local_micro_batches, sample_batches, stdlib_corpus
from tinyscale.data_parallel import BucketedDDP, NaiveDDP
from tinyscale.dist import comm
from tinyscale.models import GPT, GPTConfig

WARMUP = 2  # rounds dropped; the last of them records the all-reduce calls and bytes (comm ledger)


# --only's names for the optional rows (torch DDP and BucketedDDP always run: the ratio's pair)
OPTIONAL = {"naive": "NaiveDDP", "small": "Bucketed, {small_mb:g} MB buckets", "no-overlap": "Bucketed, no overlap",
            "no-sync": "no sync (compute only)"}


def _variants(bucket_mb: float, first_mb: float, small_mb: float, only: list[str] | None = None) -> dict:
    buckets = {"bucket_cap_mb": bucket_mb, "first_bucket_cap_mb": first_mb}
    every = {
        "torch DDP": lambda m: torch.nn.parallel.DistributedDataParallel(m),
        "BucketedDDP": lambda m: BucketedDDP(m, **buckets),
        "NaiveDDP": lambda m: NaiveDDP(m),
        f"Bucketed, {small_mb:g} MB buckets": lambda m: BucketedDDP(m, bucket_cap_mb=small_mb),
        "Bucketed, no overlap": lambda m: BucketedDDP(m, **buckets, overlap=False),
        "no sync (compute only)": lambda m: BucketedDDP(m, **buckets),
    }
    dropped = {OPTIONAL[k].format(small_mb=small_mb) for k in OPTIONAL if only is not None and k not in only}
    return {name: make for name, make in every.items() if name not in dropped}


def _bench_rank(model_name: str, steps: int, micro: int, bucket_mb: float, first_mb: float, small_mb: float,
                only: list[str] | None = None) -> dict:
    cfg = GPTConfig.preset(model_name)
    world, rank = dist.get_world_size(), dist.get_rank()
    batches = sample_batches(stdlib_corpus("train").tokens, num_batches=steps + WARMUP, batch_size=micro * world,
                             seq_len=cfg.max_seq_len, seed=0)
    # Every variant gets its own model and optimizer.
    runs = {}
    for name, make in _variants(bucket_mb, first_mb, small_mb, only).items():
        model = GPT(cfg, seed=0)
        ddp = make(model)
        runs[name] = {"model": model, "ddp": ddp, "opt": torch.optim.AdamW(model.parameters(), lr=1e-3),
                      "context": ddp.no_sync if name.startswith("no sync") else contextlib.nullcontext,
                      "calls": 0, "bytes": 0,
                      "buckets": len(ddp.buckets) if isinstance(ddp, BucketedDDP) else None}

    def step(run, i):
        (local,) = local_micro_batches(batches[i], dp_rank=rank, dp_size=world, micro_batch_size=micro)
        # the ledger on the last warm-up round only: a row costs ours each launch, and torch's none
        with comm.record() if i == WARMUP - 1 else contextlib.nullcontext() as ledger:
            with run["context"]():
                run["ddp"](*local).backward()
            run["opt"].step()
            run["opt"].zero_grad(set_to_none=True)
        if ledger is not None:
            run["calls"], run["bytes"] = ledger.calls("all_reduce"), ledger.bytes("all_reduce")

    # the compared pair side by side, trading places every other round: what runs just before a
    # step changes its time (after NaiveDDP's 39 blocking all-reduces about 1 ms of 70: lesson 02)
    times = round_robin({name: lambda i, run=run: step(run, i) for name, run in runs.items()}, steps, warmup=WARMUP,
                        before=dist.barrier, alternate=("torch DDP", "BucketedDDP"))
    out = {}
    for name, run in runs.items():
        calls, nbytes = run["calls"], run["bytes"]
        if name == "torch DDP":  # its collectives bypass our ledger: its own log counts its buckets
            calls = run["ddp"]._get_ddp_logging_data().get("num_buckets_reduced")  # (after its rebuild: 2 here)
            nbytes = sum(p.numel() * p.element_size() for p in run["model"].parameters())
        out[name] = {"times": times[name], "calls": calls, "bytes": nbytes, "buckets": run["buckets"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=30, help="timed rounds (each variant one step a round)")
    parser.add_argument("--model", default="small", choices=["tiny", "small"])
    parser.add_argument("--micro", type=int, default=4, help="rows per rank per step")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="BucketedDDP bucket size (torch's default)")
    parser.add_argument("--first-bucket-mb", type=float, default=1.0,
                        help="BucketedDDP's first bucket (torch's 1 MiB: communication starts early)")
    parser.add_argument("--small-bucket-mb", type=float, default=0.5, help="the small-bucket variant's size")
    parser.add_argument("--only", nargs="*", choices=sorted(OPTIONAL), default=None,
                        help="besides torch DDP and BucketedDDP, only these rows (none: the pair alone)")
    add_json_argument(parser)
    args = parser.parse_args()
    console = Console()
    ratios, intervals, raw = {}, {}, {}
    for world in args.world_sizes:
        with console.status(f"{world} ranks..."):
            per_rank = ts.dist.launch(_bench_rank, world, args.model, args.steps, args.micro, args.bucket_mb,
                                      args.first_bucket_mb, args.small_bucket_mb, args.only, timeout_s=3600)
        r = per_rank[0]
        for name, v in r.items():
            v["steps"] = slowest([rank_result[name]["times"] for rank_result in per_rank])
            v["s"] = summary(v["steps"])
        torch_s = r["torch DDP"]["s"].median
        key = f"ddp_bucketed_vs_torch_{world}"
        ratios[key] = r["BucketedDDP"]["s"].median / torch_s
        ours, base = r["BucketedDDP"]["steps"], r["torch DDP"]["steps"]
        intervals[key] = ratio_interval(ours, base)
        each = statistics.median([a / b for a, b in zip(ours, base)])
        intervals[key + "_per_round"] = (each, *ratio_interval(ours, base, per_round=True))
        raw[world] = {name: [round(t * 1e3, 3) for t in v["steps"]] for name, v in r.items()}
        table = Table(title=f"{world} ranks ({ts.dist.resolve_backend('auto', world)}): {args.model} GPT, "
                            f"{args.micro} rows/rank, median of {args.steps} steps")
        for col in ("variant", "ms/step (min .. max)", "vs torch DDP", "all-reduce calls/step",
                    "all-reduce bytes/step"):
            table.add_column(col, justify="right")
        for name, v in r.items():
            calls = "?" if v["calls"] is None else str(v["calls"])
            if name == "torch DDP":
                calls += " (its log)"
            table.add_row(name, v["s"].ms(), f"{v['s'].median / torch_s:.2f}x", calls, f"{v['bytes']:,}")
        console.print(table)
        low, high = intervals[key]
        verdict = interval_verdict(low, high, "BucketedDDP")
        each, each_low, each_high = intervals[key + "_per_round"]
        console.print(f"BucketedDDP / torch DDP: {ratios[key]:.3f}x, 95% interval {low:.3f} .. {high:.3f} "
                      f"(bootstrap over {args.steps} paired rounds): {verdict}; the median of each round's "
                      f"ratio {each:.3f}x ({each_low:.3f} .. {each_high:.3f})")
        if "Bucketed, no overlap" not in r or "no sync (compute only)" not in r:
            continue  # (--only left out a row the overlap figure needs)
        exposed = r["Bucketed, no overlap"]["s"].median - r["no sync (compute only)"]["s"].median
        saved = r["Bucketed, no overlap"]["s"].median - r["BucketedDDP"]["s"].median
        if exposed > 0 and 0 <= saved <= exposed:
            console.print(f"communication without overlap: {exposed * 1e3:.1f} ms/step; overlap hides "
                          f"{saved * 1e3:.1f} ms of it ({saved / exposed:.0%})\n")
        else:
            console.print(f"communication {exposed * 1e3:.1f} ms/step, overlap saved {saved * 1e3:.1f} ms: "
                          "outside 0-100%, so this run's noise exceeds the effect; no overlap figure\n")
    console.print(f"machine: {torch.get_num_threads()} threads here, torch {torch.__version__}, "
                  f"{'CUDA ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU only'}; "
                  "CPU ranks share the same cores for compute and for gloo's communication, so "
                  "overlap can only hide what the cores are not already busy with.")
    write_json(args.json, ratios, model=args.model, steps=args.steps,
               intervals={k: [round(v, 4) for v in iv] for k, iv in intervals.items()},
               step_ms=raw)  # each variant's steps (the slowest rank's), round by round, per world size


if __name__ == "__main__":
    main()
