"""Ring attention against Ulysses against one process's SDPA, on the same total sequence.

    python benchmarks/context_parallel.py [--cp 2] [--seq-len 2048] [--heads 8] [--kv-heads 2]
                                          [--head-dim 64] [--steps 3] [--sharding zigzag] [--json PATH]

On `cp` rank processes (CPU, gloo), float32, causal: one forward and backward of attention
over a sequence of `seq-len` tokens, three ways:

    ring       tinyscale.context_parallel.ring_attention, each rank holding seq-len / cp tokens
    Ulysses    tinyscale.context_parallel.ulysses_attention, the same shards
    SDPA       torch.nn.functional.scaled_dot_product_attention on the whole sequence, on
               rank 0 alone while the others wait (what one device would do)

Steps are interleaved round-robin (so load changes hit all three alike), the first of each
dropped as warm-up (tinyscale.bench); it reports the median step time of the slowest
rank with its spread, the ratio to SDPA, and the bytes rank 0 put on the wire per step (comm
ledger, bus bytes). Ring and Ulysses run each block on the CPU's flash kernel
(`tinyscale.context_parallel.blocks`), as SDPA does. `--json PATH` writes cp_ring_vs_sdpa and
cp_ulysses_vs_sdpa. PyTorch's own
context parallel is not in the race: in torch 2.13 it raises NotImplementedError on CPU (no
sharding strategy for aten._scaled_dot_product_flash_attention_for_cpu).
Lesson: lessons/09-context-parallel.md.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

import tinyscale as ts
from tinyscale.bench import add_json_argument, round_robin, slowest, summary, write_json
from tinyscale.context_parallel import Layout, ring_attention, shard, ulysses_attention
from tinyscale.dist import comm

VARIANTS = ["ring", "Ulysses", "SDPA (one process)"]


def _step(variant: str, q, k, v, layout: Layout) -> None:
    if variant == "ring":
        out = ring_attention(q, k, v, None, layout=layout, causal=True)[0]
    elif variant == "Ulysses":
        out = ulysses_attention(q, k, v, None, layout=layout, causal=True)
    else:
        G = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), is_causal=True)
    out.sum().backward()


def bench(T: int, H: int, K: int, D: int, steps: int, sharding: str) -> dict:
    """On every rank: {variant: [seconds per step]} and {variant: bus bytes per step}."""
    torch.set_num_threads(1)
    cp, rank = dist.get_world_size(), dist.get_rank()
    layout = Layout(cp, sharding, T)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, n, T, D, generator=g) for n in (H, K, K)]  # q, k, v (1, heads, T, D)
    mine = [shard(t, layout, rank, dim=2) for t in full]
    wire = {}

    def step(variant, _i):
        one_process = variant.startswith("SDPA")
        inputs = [t.clone().requires_grad_() for t in (full if one_process else mine)]
        with comm.record() as ledger:
            if not one_process or rank == 0:
                _step(variant, *inputs, layout)
        wire[variant] = ledger.bus_bytes()

    times = round_robin({v: lambda i, v=v: step(v, i) for v in VARIANTS}, steps, warmup=1, before=dist.barrier)
    return {"times": times, "wire": wire}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sharding", choices=["zigzag", "contiguous"], default="zigzag")
    add_json_argument(parser)
    a = parser.parse_args()
    if a.heads % a.cp:
        parser.error(f"--heads {a.heads} is not divisible by --cp {a.cp}: Ulysses needs it (pick a cp that divides it)")
    results = ts.dist.launch(bench, a.cp, a.seq_len, a.heads, a.kv_heads, a.head_dim, a.steps, a.sharding,
                             timeout_s=1800)
    stats = {v: summary(slowest([r["times"][v] for r in results])) for v in VARIANTS}
    medians = {v: s.median for v, s in stats.items()}
    table = Table(title=f"causal attention, forward + backward: T={a.seq_len}, H={a.heads}, K={a.kv_heads}, "
                        f"D={a.head_dim}, float32, cp={a.cp} ({a.sharding}), CPU/gloo, 1 thread per rank")
    for col in ("variant", "median step ms (min .. max)", "vs SDPA", "rank 0 bytes on the wire"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for v in VARIANTS:
        table.add_row(v, stats[v].ms(), f"{medians[v] / medians[VARIANTS[-1]]:.2f}x",
                      f"{results[0]['wire'][v]:,.0f}")
    Console().print(table)
    sdpa = medians[VARIANTS[-1]]
    write_json(a.json, {"cp_ring_vs_sdpa": medians["ring"] / sdpa, "cp_ulysses_vs_sdpa": medians["Ulysses"] / sdpa},
               seq_len=a.seq_len, cp=a.cp, steps=a.steps)


if __name__ == "__main__":
    main()
