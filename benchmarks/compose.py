"""The engine's composed dp x tp (or dp x pp) step against the same layout from PyTorch's own pieces.

    python benchmarks/compose.py [--dp 2] [--tp 2] [--steps 8] [--d-model 128] [--json PATH]
    python benchmarks/compose.py --pp 2 [--dp 2] [--tp 1] [--microbatches 4] [--layers 4]   # the pipeline

On the same rank processes (CPU, gloo) and the same batches, it times one full training step
(forward, backward, AdamW step) of a float32 GPT in two ways:

    engine                tinyscale.initialize with parallel.tensor = tp, zero_optimization.stage 3
                          over dp (and stage 0 when dp is 1)
    torch DTensor+FSDP2   parallelize_module with torchtitan's block plan, then fully_shard over dp
                          (`tinyscale.engine.torch_compose`: the blocks split, the embedding and
                          head whole on every TP rank)
    torch 1F1B+FSDP2      with --pp p: Schedule1F1B over PipelineStage(GPTStage) with each stage's
                          blocks split over tp as above and the stage fully_shard over dp
                          (`torch_pipelined_gpt`), against the engine's
                          parallel.pipeline = p, 1f1b, the same m micro-batches per dp rank

steps interleaved round-robin so that load changes hit both alike, the first two of each dropped as
warm-up. It prints the median step time, the spread, the ratio engine / torch measured in this run,
and the engine's bytes on the wire per step (the comm ledger; torch's collectives bypass it). The
same two layouts agree in float64 (`pytest -k layout_torch`). Lesson: lessons/12-engine.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import tinyscale as ts
from tinyscale.bench import add_json_argument, write_json
from tinyscale.data import synthetic_token_batches
from tinyscale.dist import ParallelMesh
from tinyscale.engine.torch_compose import pipelined_step, torch_composed_gpt, torch_pipelined_gpt
from tinyscale.models import GPT, GPTConfig


def torch_name(pp: int, dp: int, tp: int) -> str:
    parts = (["1F1B"] if pp > 1 else []) + (["DTensor"] if tp > 1 or pp == 1 else []) + (["FSDP2"] if dp > 1 else [])
    return "torch " + "+".join(parts)


def _bench_rank(dp: int, tp: int, steps: int, rows: int, seq: int, d_model: int, n_layer: int, pp: int = 1,
                m: int = 1) -> dict:
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=512, max_seq_len=seq, n_layer=n_layer, n_head=8, n_kv_head=4, d_model=d_model,
                    tie_embeddings=False)
    batches = synthetic_token_batches(num_batches=steps + 2, batch_size=rows * dp, seq_len=seq,
                                      vocab_size=cfg.vocab_size, seed=0)
    adamw = {"lr": 1e-3, "weight_decay": 0.1}
    parallel = {"tensor": tp} | ({"pipeline": pp, "pipeline_schedule": "1f1b"} if pp > 1 else {})
    engine = ts.initialize(GPT(cfg, seed=1), {
        "train_batch_size": rows * dp, "train_micro_batch_size_per_gpu": rows // m, "gradient_accumulation_steps": m,
        "optimizer": {"type": "AdamW", "params": adamw},
        "zero_optimization": {"stage": 3 if dp > 1 else 0}, "parallel": parallel})
    mesh = ParallelMesh(dp=dp, tp=tp, pp=pp)
    if pp > 1:
        schedule, model = torch_pipelined_gpt(GPT(cfg, seed=1), mesh, m)
    else:
        model = torch_composed_gpt(GPT(cfg, seed=1), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), **adamw)
    mine = slice(mesh.rank("dp") * rows, (mesh.rank("dp") + 1) * rows)

    def torch_step(batch):
        ids, targets = batch
        if pp > 1:
            pipelined_step(schedule, mesh, ids[mine], targets[mine])
        else:
            model(ids[mine], targets[mine]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    variants = ("engine", torch_name(pp, dp, tp))
    run = {"engine": engine.train_batch, torch_name(pp, dp, tp): torch_step}
    times = {name: [] for name in variants}
    for batch in batches:
        for name in variants:
            dist.barrier()
            t0 = time.perf_counter()
            run[name](batch)
            times[name].append(time.perf_counter() - t0)
    engine.comm_ledger.clear()
    engine.train_batch(batches[0])
    return {"ms": {k: statistics.median(v[2:]) * 1e3 for k, v in times.items()},
            "spread": {k: (min(v[2:]) * 1e3, max(v[2:]) * 1e3) for k, v in times.items()},
            "engine_bus_bytes": engine.comm_ledger.bus_bytes(), "engine_calls": engine.comm_ledger.calls()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=None, help="default 2, or 1 with --pp")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (then tp is 1): torch's 1F1B vs ours")
    parser.add_argument("--microbatches", type=int, default=4, help="per dp rank per step, with --pp")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=2, help="rows per dp rank")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    add_json_argument(parser)
    args = parser.parse_args()
    if args.tp is None:
        args.tp = 1 if args.pp > 1 else 2
    if args.pp > 1:
        args.rows = max(args.rows, args.microbatches)
        if args.rows % args.microbatches:
            parser.error(f"--rows {args.rows} must be a multiple of --microbatches {args.microbatches}")
    else:
        args.microbatches = 1
    world = args.dp * args.tp * args.pp
    name = torch_name(args.pp, args.dp, args.tp)
    console = Console(width=150)
    t0 = time.perf_counter()
    with console.status(f"timing {args.steps + 2} steps of each on {world} ranks"):
        res = ts.dist.launch(_bench_rank, world, args.dp, args.tp, args.steps, args.rows, args.seq,
                             args.d_model, args.layers, args.pp, args.microbatches, timeout_s=900)[0]
    ratio = res["ms"]["engine"] / res["ms"][name]
    write_json(args.json, {f"compose_engine_vs_{name.replace(' ', '_')}": ratio}, dp=args.dp, tp=args.tp, pp=args.pp,
               microbatches=args.microbatches, **res)
    layout = (f"dp {args.dp} x pp {args.pp} x tp {args.tp} (1F1B, m={args.microbatches})" if args.pp > 1
              else f"dp {args.dp} x tp {args.tp}")
    table = Table(title=f"GPT ({args.layers} layers, d_model={args.d_model}, {args.rows} rows x {args.seq} tokens "
                        f"per dp rank, float32), {layout} on CPU gloo: one training step")
    for col in ("variant", "median ms", "fastest .. slowest", "ratio"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for variant in ("engine", name):
        lo, hi = res["spread"][variant]
        table.add_row(variant, f"{res['ms'][variant]:.1f}", f"{lo:.1f} .. {hi:.1f}",
                      f"{ratio:.2f}x torch" if variant == "engine" else "")
    console.print(table)
    console.print(f"engine: {res['engine_calls']} collectives, {res['engine_bus_bytes'] / 1e6:.2f} MB on the wire per "
                  f"rank per step. Ran in {time.perf_counter() - t0:.0f} s.")


if __name__ == "__main__":
    main()
