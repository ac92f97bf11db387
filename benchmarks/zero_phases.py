"""Where a ZeroStage1/2 step spends its time against torch DDP's: phase by phase, one run.

    python benchmarks/zero_phases.py [--steps 100]

benchmarks/zero.py's setup and variants (its `_build`: 2 gloo ranks, the small GPT in float32, 4
rows per rank, AdamW, ZeroStage1/2 with torch DDP's bucket layout), steps interleaved by
`tinyscale.bench.round_robin` in a shuffled order each round, after 3 warm-up rounds. Per step,
on each rank: the main thread's CPU (`time.thread_time`) in forward, backward (the gradient
hooks and the wait for the reductions included) and the step; the rest of the process's CPU
(gloo's threads: `time.process_time` minus the main thread's); the "tail", from the last
gradient's arrival (a post-accumulate-grad hook on every parameter) to backward's return, which
is the reduction left exposed; the step's wall time (the sharded AdamW and, for the stages,
the all-gather); and the process's minor page faults and voluntary and involuntary context
switches (`getrusage`: what fresh buffers and waits on gloo's threads cost besides CPU time).
CPU times are what the machine's load distorts least: a busy core stretches wall time, not the
CPU a thread uses. Prints rank 0's medians and each stage's ratio to DDP (the
slowest rank's step) with its 95% bootstrap interval; and ZeroStage1 against itself stepping one
tensor per parameter fragment (`flat_step = False`, as before `tinyscale.zero.flat_step`).
"""
import argparse
import os
import resource
import statistics
import time

import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import tinyscale as ts
from tinyscale.bench import ratio_interval, round_robin, slowest
from tinyscale.data import local_micro_batches, sample_batches, stdlib_corpus
from tinyscale.models import GPTConfig
from zero import _build  # benchmarks/zero.py, beside this script

PHASES = ("step ms", "fwd cpu", "bwd cpu", "tail ms", "opt ms", "opt cpu", "main cpu", "gloo cpu", "faults",
          "vol csw", "invol csw")
# "per fragment": the sharded step as before zero/flat_step.py, one tensor per parameter fragment
VARIANTS = ("torch DDP", "ZeroStage1", "ZeroStage1, per fragment", "ZeroStage2")
WARMUP = 3


def _rank(steps: int, micro: int = 4) -> dict:
    cfg = GPTConfig.preset("small")
    world, rank = dist.get_world_size(), dist.get_rank()
    batches = sample_batches(stdlib_corpus("train").tokens, num_batches=steps + WARMUP, batch_size=micro * world,
                             seq_len=cfg.max_seq_len, seed=0)
    rows = {name: [] for name in VARIANTS}

    def phases(name, impl, last, i):
        (local,) = local_micro_batches(batches[i], dp_rank=rank, dp_size=world, micro_batch_size=micro)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        p0, t0, c0 = time.process_time(), time.perf_counter(), time.thread_time()
        loss = impl.forward(*local)
        c1 = time.thread_time()
        loss.backward()
        t2, c2 = time.perf_counter(), time.thread_time()
        impl.step()
        t3, c3, p3 = time.perf_counter(), time.thread_time(), time.process_time()
        r3 = resource.getrusage(resource.RUSAGE_SELF)
        if i >= WARMUP:  # (the counts are scaled by 1e-3 so that the table's "* 1e3" prints them as they are)
            rows[name].append((t3 - t0, c1 - c0, c2 - c1, t2 - last[0], t3 - t2, c3 - c2, c3 - c0,
                               (p3 - p0) - (c3 - c0), (r3.ru_minflt - r0.ru_minflt) * 1e-3,
                               (r3.ru_nvcsw - r0.ru_nvcsw) * 1e-3, (r3.ru_nivcsw - r0.ru_nivcsw) * 1e-3))

    variants = {}
    for name in VARIANTS:
        impl, last = _build(name.removesuffix(", per fragment"), cfg), [0.0]
        if name.endswith("per fragment"):
            impl.zero.sharded.flat_step = False
        for p in impl.forward.parameters():  # when the last gradient arrived
            p.register_post_accumulate_grad_hook(lambda _, last=last: last.__setitem__(0, time.perf_counter()))
        variants[name] = lambda i, name=name, impl=impl, last=last: phases(name, impl, last, i)
    round_robin(variants, steps, warmup=WARMUP, before=dist.barrier, shuffle=0)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="timed rounds")
    steps = parser.parse_args().steps
    load = os.getloadavg()[0]
    with Console().status(f"2 ranks, {steps} rounds..."):
        per_rank = ts.dist.launch(_rank, 2, steps, timeout_s=1800)
    print(f"2 gloo ranks, small GPT, {steps} interleaved rounds; rank 0's medians (ms); load {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    table = Table("variant", *PHASES)
    for name, rows in per_rank[0].items():
        table.add_row(name, *(f"{statistics.median(col) * 1e3:.2f}" for col in zip(*rows)))
    Console(width=150).print(table)  # piped into a file too: not squeezed into 80 columns
    total = {name: slowest([[row[0] for row in r[name]] for r in per_rank]) for name in per_rank[0]}
    for name, base in (("ZeroStage1", "torch DDP"), ("ZeroStage1, per fragment", "torch DDP"),
                       ("ZeroStage2", "torch DDP"), ("ZeroStage1", "ZeroStage1, per fragment")):
        low, high = ratio_interval(total[name], total[base])
        ratio = statistics.median(total[name]) / statistics.median(total[base])
        print(f"{name} / {base}: {ratio:.3f}x (95% interval {low:.3f} .. {high:.3f})")
    opt = {name: [row[5] for row in rows] for name, rows in per_rank[0].items()}  # rank 0's step CPU
    low, high = ratio_interval(opt["ZeroStage1"], opt["ZeroStage1, per fragment"])
    ratio = statistics.median(opt["ZeroStage1"]) / statistics.median(opt["ZeroStage1, per fragment"])
    print(f"rank 0's step CPU, ZeroStage1 flat / per fragment: {ratio:.3f}x (95% interval {low:.3f} .. {high:.3f})")


if __name__ == "__main__":
    main()
