"""Issue 30's ZeRO 1/2 gap, fix by fix: torch DDP and ZeroStage1/2 with each fix off or on, one run.

    python benchmarks/zero_fixes.py [--steps 40]

Two parts, 2 gloo ranks, the small GPT in float32, 4 rows per rank (benchmarks/zero.py's setup):
1. the flat collectives on one 869,504-element float32 buffer (the GPT's gradient): torch's
   gloo all_reduce, reduce_scatter_tensor and all_gather_into_tensor against the same
   reduce-scatter and all-gather built from all_to_all_single (what `tinyscale.dist.comm` now
   does on gloo); median of 15 calls, each after a barrier;
2. one training step (forward, backward, AdamW step) of torch DDP and of ZeroStage1/2 with the
   fixes switched on one by one (`comm.GLOO_VIA_ALL_TO_ALL`, the stage's `overlap` and
   `first_bucket_bytes`, `ShardedOptimizer.flat_params`, `agree_usage_early`), interleaved
   round robin, medians of each phase on rank 0 and of the slowest rank's step. Lesson 03 quotes it.

What the variants are now: each fix that is still a switch, off ("before") or on. The last
variant of each stage is today's default (both stages launch the usage-flag all-reduce at
backward's end since ab6d29f; stage 2 blocked on it in step() before). With
agree_usage_early=False a stage agrees the flags in step(), blocking, as both did before the
fix. Code that is no longer a switch runs in every variant (ab6d29f: the flags a Python list,
a unit's first reduce-scatter straight into the gradient shard), so "before" is the old
switches on today's code, not the old code. The engine runs neither flag path: it turns
agree_usage_early off and sends the flags with the loss all-reduce.
"""
import os
import statistics
import time

import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.data import local_micro_batches, sample_batches, stdlib_corpus
from tinyscale.dist import comm
from tinyscale.models import GPT, GPTConfig
from tinyscale.zero import ZeroStage1, ZeroStage2


def adamw(p):
    return torch.optim.AdamW(p, lr=1e-3)


MB = 2**20
VARIANTS = {  # name: (stage, kwargs, a2a, flat params, early flags: launched at backward's end, else agreed in step)
    "z1 before (reduce after backward, gloo RS/AG, flags in step)": (1, dict(overlap=False), False, False, False),
    "z1 + gloo via all_to_all": (1, dict(overlap=False), True, False, False),
    "z1 + reduce in backward, 1 MiB first bucket": (1, dict(bucket_bytes=25 * MB, first_bucket_bytes=MB), True,
                                                     False, False),
    "z1 + flat params + early flags (all: default)": (1, dict(bucket_bytes=25 * MB, first_bucket_bytes=MB), True,
                                                      True, True),
    "z2 before (25 MB buckets, gloo RS/AG, flags in step)": (2, dict(bucket_bytes=25 * MB), False, False, False),
    "z2 + gloo via all_to_all": (2, dict(bucket_bytes=25 * MB), True, False, False),
    "z2 + 1 MiB first bucket + flat params": (2, dict(bucket_bytes=25 * MB, first_bucket_bytes=MB), True, True, False),
    "z2 + early flags (all: default)": (2, dict(bucket_bytes=25 * MB, first_bucket_bytes=MB), True, True, True),
}


def collectives():
    n, world = 869_504, dist.get_world_size()
    x, out, full = torch.randn(n), torch.empty(n // world), torch.empty(n)
    ops = {"all_reduce": lambda: dist.all_reduce(x),
           "torch reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out, x),
           "torch all_gather_into_tensor": lambda: dist.all_gather_into_tensor(full, out),
           "reduce_scatter via all_to_all": lambda: comm._reduce_scatter_by_all_to_all(out, x, None, False),
           "all_gather via all_to_all": lambda: comm._all_gather_by_all_to_all(full, out, None, False)}
    times = {name: [] for name in ops}
    for _ in range(15):
        for name, op in ops.items():
            dist.barrier()
            start = time.perf_counter()
            op()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def rank_fn(steps):
    cfg = GPTConfig.preset("small")
    world, rank = dist.get_world_size(), dist.get_rank()
    batches = sample_batches(stdlib_corpus("train").tokens, num_batches=steps + 2, batch_size=4 * world,
                             seq_len=cfg.max_seq_len, seed=0)
    m = GPT(cfg, seed=0)
    runs = {"torch DDP": (torch.nn.parallel.DistributedDataParallel(m), adamw(list(m.parameters())), None, False)}
    for name, (stage, kw, a2a, flat, early) in VARIANTS.items():
        m = GPT(cfg, seed=0)
        z = (ZeroStage1 if stage == 1 else ZeroStage2)(list(m.parameters()), adamw, **kw)
        z.sharded.flat_params, z.agree_usage_early = flat, early
        runs[name] = (m, None, z, a2a)
    t = {n: {"fwd": [], "bwd": [], "step": [], "total": []} for n in runs}
    for i in range(steps + 2):
        for n, (model, opt, zero, a2a) in runs.items():
            comm.GLOO_VIA_ALL_TO_ALL = a2a
            (local,) = local_micro_batches(batches[i], dp_rank=rank, dp_size=world, micro_batch_size=4)
            dist.barrier()
            a = time.perf_counter()
            loss = model(*local)
            b = time.perf_counter()
            loss.backward()
            c = time.perf_counter()
            if zero is None:
                opt.step(); opt.zero_grad(set_to_none=True)
            else:
                zero.step()
            d = time.perf_counter()
            if i >= 2:
                for k, v in zip(("fwd", "bwd", "step", "total"), (b - a, c - b, d - c, d - a)):
                    t[n][k].append(v)
    return t


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    steps = parser.parse_args().steps
    for name, t in ts.dist.launch(collectives, 2)[0].items():
        print(f"{name:35s} {t * 1e3:6.2f} ms")
    per = ts.dist.launch(rank_fn, 2, steps)
    tot = {n: statistics.median([max(a, b) for a, b in zip(per[0][n]["total"], per[1][n]["total"])]) for n in per[0]}
    print(f"{'variant':62s} {'fwd':>6s} {'bwd':>6s} {'step':>6s} {'total':>6s}  / DDP")
    for n in per[0]:
        row = " ".join(f"{statistics.median(per[0][n][k]) * 1e3:6.1f}" for k in ("fwd", "bwd", "step"))
        print(f"{n:62s} {row} {tot[n] * 1e3:6.1f}  {tot[n] / tot['torch DDP']:.3f}")
    print("load average", ", ".join(f"{v:.1f}" for v in os.getloadavg()), "(2 CPU cores, shared)")
