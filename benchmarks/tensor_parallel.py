"""Our tensor parallelism against PyTorch's DTensor `parallelize_module`, on the same GPT blocks, same run.

    python benchmarks/tensor_parallel.py [--world-size 2] [--blocks 2] [--steps 10]

On the same rank processes (CPU, gloo) and the same inputs, it times one forward and backward
of a stack of GPT blocks (GQA attention, SwiGLU MLP, RMSNorm; float32) split four ways:

    ours                     tinyscale.tensor_parallel.parallelize_block
    ours, sequence parallel  the same with sequence_parallel=True
    DTensor                  parallelize_module with torchtitan's plan: ColwiseParallel on
                             wq/wk/wv/w_gate/w_up, RowwiseParallel on wo/w_down
    DTensor, SP              + SequenceParallel on the norms, PrepareModuleInput gathering the
                             sequence before attention and the MLP (as tests/tensor_parallel does)

steps interleaved round-robin so that load changes hit all four alike, the first two of each
dropped as warm-up. It reports the median step time, the ratio ours / DTensor measured in this
run, and the collectives per step: ours from the comm ledger (calls and bytes), DTensor's counted
by torch's CommDebugMode (calls; its collectives bypass our ledger). Lesson: lessons/07-tensor-parallel.md.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import tinyscale as ts
from tinyscale.bench import add_json_argument, write_json
from tinyscale.dist import ParallelMesh, comm
from tinyscale.models import GPTConfig
from tinyscale.models.gpt import Block, rope_tables
from tinyscale.tensor_parallel import parallelize_block
from tinyscale.tensor_parallel.dtensor_plan import torch_block_plan

VARIANTS = ["ours", "ours, sequence parallel", "DTensor", "DTensor, SP"]
REFERENCE = {"ours": "DTensor", "ours, sequence parallel": "DTensor, SP"}


def _bench_rank(n_blocks: int, steps: int, batch: int, seq: int, d_model: int) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module
    torch.set_num_threads(1)
    n, r = dist.get_world_size(), dist.get_rank()
    cfg = GPTConfig(n_head=8, n_kv_head=4, d_model=d_model, ffn_hidden=(8 * d_model // 3 + 31) // 32 * 32,
                    max_seq_len=seq)
    torch.manual_seed(0)  # the same full blocks on every rank
    dense = torch.nn.ModuleList(Block(cfg, dtype=torch.float32) for _ in range(n_blocks))
    mesh = ParallelMesh(tp=n).device_mesh["tp"]
    models = {}
    for name in VARIANTS:
        sp = name in ("ours, sequence parallel", "DTensor, SP")
        blocks = copy.deepcopy(dense)
        for block in blocks:
            if name.startswith("ours"):
                parallelize_block(block, dist.group.WORLD, sequence_parallel=sp)
            else:
                parallelize_module(block, mesh, torch_block_plan(sp))
        models[name] = (blocks, sp)
    cos, sin = (t.float() for t in rope_tables(seq, cfg.head_dim, cfg.rope_theta))
    x_full = torch.randn(batch, seq, d_model, generator=torch.Generator().manual_seed(1))

    def step(name):
        blocks, sp = models[name]
        x = (x_full.chunk(n, 1)[r] if sp else x_full).clone().requires_grad_(True)
        for block in blocks:
            x = block(x, cos, sin)
        x.float().pow(2).mean().backward()
        for p in blocks.parameters():
            p.grad = None

    times = {name: [] for name in VARIANTS}
    for _ in range(steps + 2):
        for name in VARIANTS:
            dist.barrier()
            t0 = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - t0)
    comms = {}
    for name in VARIANTS:
        if name.startswith("ours"):
            with comm.record() as ledger:
                step(name)
            comms[name] = {op: (ledger.calls(op), ledger.bytes(op)) for op in ("all_reduce", "all_gather", "reduce_scatter")
                           if ledger.calls(op)}
        else:
            with CommDebugMode() as debug:
                step(name)
            comms[name] = {str(op).split(".")[-1]: (count, None) for op, count in debug.get_comm_counts().items()}
    return {"ms": {k: statistics.median(v[2:]) * 1e3 for k, v in times.items()},
            "spread": {k: (min(v[2:]) * 1e3, max(v[2:]) * 1e3) for k, v in times.items()}, "comms": comms}


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e6:.2f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.1f} kB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=256)
    add_json_argument(parser)
    args = parser.parse_args()
    console = Console(width=150)
    t0 = time.perf_counter()
    res = ts.dist.launch(_bench_rank, args.world_size, args.blocks, args.steps, args.batch, args.seq, args.d_model,
                         timeout_s=600)[0]
    table = Table(title=f"{args.blocks} GPT blocks (d_model={args.d_model}, B={args.batch}, T={args.seq}, float32), "
                        f"tp={args.world_size} on CPU gloo: forward + backward")
    for col in ("variant", "median ms", "fastest .. slowest", "ratio", "collectives per step"):
        table.add_column(col, justify="left" if col in ("variant", "collectives per step") else "right")
    for name in VARIANTS:
        ref = REFERENCE.get(name)
        ratio = f"{res['ms'][name] / res['ms'][ref]:.2f}x {ref}" if ref else ""
        lo, hi = res["spread"][name]
        comms = ", ".join(f"{op} {c}" + (f" ({_size(b)})" if b is not None else "")
                          for op, (c, b) in sorted(res["comms"][name].items()))
        table.add_row(name, f"{res['ms'][name]:.1f}", f"{lo:.1f} .. {hi:.1f}", ratio, comms)
    console.print(table)
    B, T, C = args.batch, args.seq, args.d_model
    console.print(f"formula: 2 all-reduces of B*T*C*4 = {B * T * C * 4 / 1e6:.2f} MB per block each way "
                  f"({4 * args.blocks} per step); with SP as many all-gathers and reduce-scatters of that size. "
                  f"Ran in {time.perf_counter() - t0:.0f} s.")
    write_json(args.json, {}, ms=res["ms"], spread=res["spread"])


if __name__ == "__main__":
    main()
