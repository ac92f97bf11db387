"""Ring attention against Ulysses against one process's SDPA, on the same total sequence.

    python benchmarks/context_parallel.py [--cp 2] [--seq-len 2048] [--heads 8] [--kv-heads 2]
                                          [--head-dim 64] [--steps 3] [--sharding zigzag] [--json PATH]
                                          [--profile N]

On `cp` rank processes (CPU, gloo), float32, causal: one forward and backward of attention
over a sequence of `seq-len` tokens, four ways:

    ring           tinyscale.context_parallel.ring_attention, each rank holding seq-len / cp tokens
    Ulysses        tinyscale.context_parallel.ulysses_attention, the same shards
    SDPA, 1 thread torch.nn.functional.scaled_dot_product_attention on the whole sequence, on
                   rank 0 alone while the others wait: what one device would do
    SDPA, cp threads  the same with cp threads: one process on as many cores as the cp ranks

Threads, stated in the table: a "device" is one core. Every rank runs 1 thread (so cp ranks
use cp cores and never oversubscribe them); `cp_ring_vs_sdpa` / `cp_ulysses_vs_sdpa` compare
them with one device (SDPA on 1 thread: the ideal is 1/cp, issue 30's goal <= 0.75), and
`..._same_cores` with SDPA on cp threads (the same total cores: the ideal is 1, less what
SDPA's threads fail to scale).

Steps are interleaved round-robin (so load changes hit all alike), the first of each
dropped as warm-up (tinyscale.bench); it reports the median step time of the slowest
rank with its spread, the ratio to SDPA, the median CPU time of the busiest rank (its
process's CPU seconds in the step, all threads: on a shared machine the figure load changes
least, since waiting for a core is not counted; the `_cpu` keys), and the bytes rank 0 put
on the wire per step (comm ledger, bus bytes). Ring and Ulysses run each block on the CPU's
flash kernel (`tinyscale.context_parallel.blocks`), as SDPA does. `--profile N` then runs
one more step of each under torch.profiler and prints each rank's N ops with the most self
time (where the time beyond the kernel's share goes). PyTorch's own
context parallel is not in the race: in torch 2.13 it raises NotImplementedError on CPU (no
sharding strategy for aten._scaled_dot_product_flash_attention_for_cpu).
Lesson: lessons/09-context-parallel.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import tinyscale as ts
from tinyscale.bench import add_json_argument, round_robin, slowest, summary, write_json
from tinyscale.context_parallel import Layout, ring_attention, shard, ulysses_attention
from tinyscale.dist import comm

SDPA_1, SDPA_CP = "SDPA, 1 process, 1 thread", "SDPA, 1 process, cp threads"
VARIANTS = ["ring", "Ulysses", SDPA_1, SDPA_CP]


def _step(variant: str, q, k, v, layout: Layout) -> None:
    if variant == "ring":
        out = ring_attention(q, k, v, None, layout=layout, causal=True)[0]
    elif variant == "Ulysses":
        out = ulysses_attention(q, k, v, None, layout=layout, causal=True)
    else:
        G = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), is_causal=True)
    out.sum().backward()


def bench(T: int, H: int, K: int, D: int, steps: int, sharding: str, profile: int) -> dict:
    """On every rank: {variant: [seconds per step]}, {variant: [CPU seconds per step]}, {variant:
    bus bytes per step}, and (profile > 0) {variant: this rank's top ops by self time}."""
    torch.set_num_threads(1)  # one core per rank: cp ranks on cp cores
    cp, rank = dist.get_world_size(), dist.get_rank()
    layout = Layout(cp, sharding, T)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, n, T, D, generator=g) for n in (H, K, K)]  # q, k, v (1, heads, T, D)
    mine = [shard(t, layout, rank, dim=2) for t in full]
    wire, cpu = {}, {v: [] for v in VARIANTS}

    def step(variant, _i):
        one_process = variant.startswith("SDPA")
        inputs = [t.clone().requires_grad_() for t in (full if one_process else mine)]
        start = time.process_time()
        with comm.record() as ledger:
            if not one_process or rank == 0:
                torch.set_num_threads(cp if variant == SDPA_CP else 1)
                _step(variant, *inputs, layout)
                torch.set_num_threads(1)
        cpu[variant].append(time.process_time() - start)
        wire[variant] = ledger.bus_bytes()

    warmup = 1
    times = round_robin({v: lambda i, v=v: step(v, i) for v in VARIANTS}, steps, warmup=warmup, before=dist.barrier)
    ops = {}
    for variant in VARIANTS[:3] if profile > 0 else ():
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step(variant, 0)
        top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:profile]
        ops[variant] = [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in top]
    return {"times": times, "cpu": {v: c[warmup:warmup + steps] for v, c in cpu.items()}, "wire": wire, "ops": ops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sharding", choices=["zigzag", "contiguous"], default="zigzag")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after timing, profile one step of each and print each rank's N ops with most self time")
    add_json_argument(parser)
    a = parser.parse_args()
    if a.heads % a.cp:
        parser.error(f"--heads {a.heads} is not divisible by --cp {a.cp}: Ulysses needs it (pick a cp that divides it)")
    results = ts.dist.launch(bench, a.cp, a.seq_len, a.heads, a.kv_heads, a.head_dim, a.steps, a.sharding,
                             a.profile, timeout_s=1800)
    stats = {v: summary(slowest([r["times"][v] for r in results])) for v in VARIANTS}
    cpu = {v: statistics.median(slowest([r["cpu"][v] for r in results])) for v in VARIANTS}
    medians = {v: s.median for v, s in stats.items()}
    table = Table(title=f"causal attention, forward + backward: T={a.seq_len}, H={a.heads}, K={a.kv_heads}, "
                        f"D={a.head_dim}, float32, cp={a.cp} ({a.sharding}), CPU/gloo; each rank 1 thread "
                        f"(cp ranks = {a.cp} cores); SDPA on 1 thread (one device) and on {a.cp} (the same cores)")
    for col in ("variant", "median step ms (min .. max)", "vs SDPA 1 thread", f"vs SDPA {a.cp} threads",
                "CPU ms, busiest rank", "rank 0 bytes on the wire"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for v in VARIANTS:
        table.add_row(v, stats[v].ms(), f"{medians[v] / medians[SDPA_1]:.2f}x", f"{medians[v] / medians[SDPA_CP]:.2f}x",
                      f"{cpu[v] * 1e3:.1f}", f"{results[0]['wire'][v]:,.0f}")
    Console(width=150).print(table)
    for r, result in enumerate(results):
        for v, ops in result["ops"].items():
            print(f"rank {r}, {v}: " + "; ".join(f"{name} {ms:.1f} ms x{n}" for name, ms, n in ops))
    ratios = {}
    for key, v in (("ring", "ring"), ("ulysses", "Ulysses")):
        ratios[f"cp_{key}_vs_sdpa"] = medians[v] / medians[SDPA_1]
        ratios[f"cp_{key}_vs_sdpa_same_cores"] = medians[v] / medians[SDPA_CP]
        ratios[f"cp_{key}_vs_sdpa_cpu"] = cpu[v] / cpu[SDPA_1]
    write_json(a.json, ratios, seq_len=a.seq_len, cp=a.cp, steps=a.steps, threads_per_rank=1,
               sdpa_threads={SDPA_1: 1, SDPA_CP: a.cp})


if __name__ == "__main__":
    main()
