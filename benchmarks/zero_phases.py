"""Where a ZeroStage1/2 step spends its time against torch DDP's: phase by phase, one run.

    python benchmarks/zero_phases.py [--steps 100]

benchmarks/zero.py's setup (2 gloo ranks, the small GPT in float32, 4 rows per rank, AdamW,
ZeroStage1/2 with torch DDP's bucket layout), steps interleaved round robin after 3 warm-up
rounds. Per step, on each rank: the main thread's CPU (`time.thread_time`) in forward,
backward (the gradient hooks and the wait for the reductions included) and the step; the rest
of the process's CPU (gloo's threads: `time.process_time` minus the main thread's); the
"tail", from the last gradient's arrival (a post-accumulate-grad hook on every parameter) to
backward's return, which is the reduction left exposed; and the step's wall time (the
sharded AdamW and, for the stages, the all-gather). CPU times are what the machine's load
distorts least: a busy core stretches wall time, not the CPU a thread uses. Prints rank 0's
medians and each stage's ratio to DDP (the slowest rank's step) with its 95% bootstrap interval.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.bench import ratio_interval, slowest
from tinyscale.data import local_micro_batches, sample_batches, stdlib_corpus
from tinyscale.models import GPT, GPTConfig
from tinyscale.zero import ZeroStage1, ZeroStage2

PHASES = ("step ms", "fwd cpu", "bwd cpu", "tail ms", "opt ms", "opt cpu", "main cpu", "gloo cpu")


def _build(name, cfg):
    model = GPT(cfg, seed=0)
    params = list(model.parameters())
    if name == "torch DDP":
        opt = torch.optim.AdamW(params, lr=1e-3)

        def step():
            opt.step()
            opt.zero_grad(set_to_none=True)
        return torch.nn.parallel.DistributedDataParallel(model), params, step
    stage = ZeroStage1 if name == "ZeroStage1" else ZeroStage2
    zero = stage(params, lambda groups: torch.optim.AdamW(groups, lr=1e-3), bucket_bytes=25 * 2**20,
                 first_bucket_bytes=2**20)
    return model, params, zero.step


def _rank(steps: int, micro: int = 4) -> dict:
    cfg = GPTConfig.preset("small")
    world, rank = dist.get_world_size(), dist.get_rank()
    batches = sample_batches(stdlib_corpus("train").tokens, num_batches=steps + 3, batch_size=micro * world,
                             seq_len=cfg.max_seq_len, seed=0)
    runs = {}
    for name in ("torch DDP", "ZeroStage1", "ZeroStage2"):
        forward, params, step = _build(name, cfg)
        last = [0.0]
        for p in params:
            p.register_post_accumulate_grad_hook(lambda _, last=last: last.__setitem__(0, time.perf_counter()))
        runs[name] = (forward, step, last, [])
    for i in range(steps + 3):
        for forward, step, last, rows in runs.values():
            (local,) = local_micro_batches(batches[i], dp_rank=rank, dp_size=world, micro_batch_size=micro)
            dist.barrier()
            p0, t0, c0 = time.process_time(), time.perf_counter(), time.thread_time()
            loss = forward(*local)
            c1 = time.thread_time()
            loss.backward()
            t2, c2 = time.perf_counter(), time.thread_time()
            step()
            t3, c3, p3 = time.perf_counter(), time.thread_time(), time.process_time()
            if i >= 3:
                rows.append((t3 - t0, c1 - c0, c2 - c1, t2 - last[0], t3 - t2, c3 - c2, c3 - c0,
                             (p3 - p0) - (c3 - c0)))
    return {name: rows for name, (_, _, _, rows) in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="timed rounds")
    steps = parser.parse_args().steps
    load = os.getloadavg()[0]
    per_rank = ts.dist.launch(_rank, 2, steps, timeout_s=1800)
    print(f"2 gloo ranks, small GPT, {steps} interleaved rounds; rank 0's medians (ms); load {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"{'':12s}" + "".join(f"{k:>10s}" for k in PHASES))
    for name, rows in per_rank[0].items():
        print(f"{name:12s}" + "".join(f"{statistics.median(col) * 1e3:10.2f}" for col in zip(*rows)))
    total = {name: slowest([[row[0] for row in r[name]] for r in per_rank]) for name in per_rank[0]}
    for name in ("ZeroStage1", "ZeroStage2"):
        low, high = ratio_interval(total[name], total["torch DDP"])
        ratio = statistics.median(total[name]) / statistics.median(total["torch DDP"])
        print(f"{name} / torch DDP: {ratio:.3f}x (95% interval {low:.3f} .. {high:.3f})")


if __name__ == "__main__":
    main()
