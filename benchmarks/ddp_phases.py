"""Where a BucketedDDP step spends its CPU against torch DDP's, at N ranks: counted, one run.

    python benchmarks/ddp_phases.py [--world 4] [--steps 40] [--variants torch ours torch ours]

benchmarks/ddp.py's setup (the small GPT in float32, 4 rows per rank, AdamW, torch's bucket
layout: 25 MiB buckets, the first 1 MiB), the variants' steps interleaved by
`tinyscale.bench.round_robin` in a shuffled order each round, after 3 warm-up rounds; a variant
named twice gets a second, identical copy (an A/A pair: how far two equal things differ in this
run). Per step, on each rank, what the machine's load distorts least: the main thread's CPU
(forward, backward with the hooks and the final wait, AdamW), the CPU of every other thread of
the process (gloo's, from /proc/self/task/*/schedstat), each side's voluntary and involuntary
context switches (/proc/self/task/*/status), the process's minor page faults (getrusage), and
the wall time of the step and of its tail (the last gradient's arrival to backward's return).
Prints the means over ranks and steps (a step's wall time on shared cores follows the CPU that
all ranks spend, a sum: so means, not medians) with each variant's difference from the first,
paired by rank and round, and each variant's ratio to the first (the slowest rank's step, ratio
of medians) with its 95% bootstrap interval.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import threading
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import tinyscale as ts
from tinyscale.bench import ratio_interval, round_robin, slowest
from tinyscale.data import local_micro_batches, sample_batches, stdlib_corpus
from tinyscale.data_parallel import BucketedDDP
from tinyscale.dist import comm
from tinyscale.models import GPT, GPTConfig

WARMUP = 3
COLUMNS = ("step ms", "tail ms", "fwd cpu", "bwd cpu", "opt cpu", "main cpu", "others cpu", "process cpu",
           "main vcsw", "main ivcsw", "others vcsw", "others ivcsw", "minflt")
MAKERS = {
    "torch": lambda m: torch.nn.parallel.DistributedDataParallel(m),
    "ours": lambda m: BucketedDDP(m, bucket_cap_mb=25.0, first_bucket_cap_mb=1.0),
}


def _threads() -> dict[int, tuple[int, int, int]]:
    """{tid: (CPU ns, voluntary, involuntary context switches)} of every thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/status") as f:
                status = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
        except FileNotFoundError:  # (a thread that ended meanwhile)
            continue
        out[int(tid)] = (ns, int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"]))
    return out


def _delta(before: dict, after: dict, main: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(main thread's, the other threads' summed) increase of each field."""
    def d(tid):
        a = after[tid]
        b = before.get(tid, (0, 0, 0))
        return tuple(x - y for x, y in zip(a, b))
    others = [d(t) for t in after if t != main]
    return d(main), tuple(sum(col) for col in zip(*others)) if others else (0, 0, 0)


def _rank(steps: int, names: list[str], micro: int = 4) -> dict:
    cfg = GPTConfig.preset("small")
    world, rank = dist.get_world_size(), dist.get_rank()
    batches = sample_batches(stdlib_corpus("train").tokens, num_batches=steps + WARMUP, batch_size=micro * world,
                             seq_len=cfg.max_seq_len, seed=0)
    main = threading.get_native_id()
    rows: dict[str, list[tuple]] = {}

    def step(label, ddp, opt, last, i):
        (local,) = local_micro_batches(batches[i], dp_rank=rank, dp_size=world, micro_batch_size=micro)
        th0, r0 = _threads(), resource.getrusage(resource.RUSAGE_SELF)
        p0, t0, c0 = time.process_time(), time.perf_counter(), time.thread_time()
        with comm.record():  # as benchmarks/ddp.py's step
            loss = ddp(*local)
            c1 = time.thread_time()
            loss.backward()
            t2, c2 = time.perf_counter(), time.thread_time()
            opt.step()
            opt.zero_grad(set_to_none=True)
        t3, c3, p3 = time.perf_counter(), time.thread_time(), time.process_time()
        r3, th3 = resource.getrusage(resource.RUSAGE_SELF), _threads()
        (m_ns, m_v, m_iv), (o_ns, o_v, o_iv) = _delta(th0, th3, main)
        if i >= WARMUP:  # seconds, and counts as they are
            rows[label].append((t3 - t0, t2 - last[0], c1 - c0, c2 - c1, c3 - c2, m_ns * 1e-9, o_ns * 1e-9, p3 - p0,
                                m_v, m_iv, o_v, o_iv, r3.ru_minflt - r0.ru_minflt))

    variants = {}
    for k, name in enumerate(names):
        label = f"{name} {names[:k].count(name) + 1}"
        model = GPT(cfg, seed=0)
        ddp, last = MAKERS[name](model), [0.0]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():  # when the last gradient arrived (registered after the wrapper's hooks)
            p.register_post_accumulate_grad_hook(lambda _, last=last: last.__setitem__(0, time.perf_counter()))
        rows[label] = []
        variants[label] = lambda i, a=(label, ddp, opt, last): step(*a, i)
    round_robin(variants, steps, warmup=WARMUP, before=dist.barrier, shuffle=0)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40, help="timed rounds")
    parser.add_argument("--variants", nargs="+", choices=sorted(MAKERS), default=["torch", "ours", "torch", "ours"])
    args = parser.parse_args()
    load = os.getloadavg()
    with Console().status(f"{args.world} ranks, {len(args.variants)} variants x {args.steps} rounds..."):
        per_rank = ts.dist.launch(_rank, args.world, args.steps, args.variants, timeout_s=1800)
    print(f"{args.world} gloo ranks, small GPT, {args.steps} shuffled rounds; means over ranks and steps "
          f"(ms, counts per step); load {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    base = next(iter(per_rank[0]))
    table = Table("per step, mean", *per_rank[0])  # rows: the columns; columns: the variants
    for j, col in enumerate(COLUMNS):
        scale = 1e3 if j < 8 else 1  # seconds in ms; counts as they are
        cells = []
        for label in per_rank[0]:
            values = [row[j] * scale for r in per_rank for row in r[label]]
            cell = f"{statistics.fmean(values):.2f}"
            if label != base:  # the paired difference (same rank, same round) and its 95% normal interval
                diffs = [(a[j] - b[j]) * scale for r in per_rank for a, b in zip(r[label], r[base])]
                half = 1.96 * statistics.stdev(diffs) / len(diffs) ** 0.5
                cell += f" ({statistics.fmean(diffs):+.2f} ± {half:.2f})"
            cells.append(cell)
        table.add_row(col, *cells)
    Console(width=200).print(table)
    print(f"(in brackets: minus {base}, paired by rank and round, ± the 95% half-width)")
    total = {label: slowest([[row[0] for row in r[label]] for r in per_rank]) for label in per_rank[0]}
    base = next(iter(total))
    for label, steps in total.items():
        low, high = ratio_interval(steps, total[base])
        print(f"{label} / {base}: {statistics.median(steps) / statistics.median(total[base]):.3f}x "
              f"(95% interval {low:.3f} .. {high:.3f}), median {statistics.median(steps) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
