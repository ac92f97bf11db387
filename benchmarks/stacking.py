"""Stacking memory savings: accumulation x precision x checkpointing x ZeRO stage, in one table.

Answers DS-38 (lesson 03, "Stacking the savings"): the same GPT and global batch trained
through the engine on N CPU ranks under every combination of

    accumulation   the global batch in 1 micro-batch per rank, or in 4
    precision      float32, or bf16 mixed precision (fp32 master weights)
    checkpointing  none, or full recomputation of every block
    ZeRO stage     0 (DDP), 1, 2, 3

and, per rank, the model states at their peak (`memory_report("before_step")`: parameters,
gradients, optimizer states, master weights), the peak bytes of the tensors a step creates
(`tinyscale.checkpointing.peak_bytes`: activations, gradients and temporaries), the median
step time, and the final loss (the combinations train the same batches, so the losses agree
to the precision's rounding). bf16 matmuls are slow on CPUs without bf16 instructions: read
its times as this machine's, not as a GPU's.

    .venv/bin/python benchmarks/stacking.py [--world-size 2] [--model tiny] [--steps 3]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

import tinyscale as ts
from tinyscale.bench import add_json_argument, write_json
from tinyscale.checkpointing.measure import peak_bytes
from tinyscale.data import sample_batches, stdlib_corpus
from tinyscale.models import GPT, GPTConfig

GLOBAL_ROWS_PER_RANK = 8


def combos() -> list[dict]:
    return [dict(accum=a, precision=p, ckpt=c, stage=s)
            for a, p, c, s in itertools.product((1, 4), ("float32", "bf16"), ("none", "full"), (0, 1, 2, 3))]


def engine_config(combo: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": GLOBAL_ROWS_PER_RANK // combo["accum"],
            "gradient_accumulation_steps": combo["accum"],
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "bf16": {"enabled": combo["precision"] == "bf16"},
            "activation_checkpointing": {"policy": combo["ckpt"]},
            "zero_optimization": {"stage": combo["stage"]}}


def run_rank(model_name: str, steps: int) -> list[dict] | None:
    cfg = GPTConfig.preset(model_name)
    rows = []
    for combo in combos():
        torch.manual_seed(0)
        engine = ts.initialize(GPT(cfg, seed=0, dtype=torch.float32), engine_config(combo))
        batches = sample_batches(stdlib_corpus("train").tokens, num_batches=steps,
                                 batch_size=GLOBAL_ROWS_PER_RANK * ts.dist.world_size(),
                                 seq_len=cfg.max_seq_len, seed=0)
        times, peaks, losses = [], [], []
        for batch in batches:
            start = time.perf_counter()
            peaks.append(peak_bytes(lambda b=batch: losses.append(engine.train_batch(b))))
            times.append(time.perf_counter() - start)
        states = engine.memory_report("before_step").as_dict()["total"]
        rows.append({**combo, "model_states": states, "step_peak": max(peaks),
                     "step_s": statistics.median(times[1:] or times), "loss": losses[-1]})
    return rows if ts.dist.rank() == 0 else None


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=3)
    add_json_argument(parser)
    args = parser.parse_args(argv)
    rows = ts.dist.launch(run_rank, args.world_size, args.model, args.steps, timeout_s=1800)[0]
    print(f"{args.model} GPT, {args.world_size} ranks, {GLOBAL_ROWS_PER_RANK} rows per rank per step; "
          "bytes per rank (KiB)")
    print(f"{'accum':>5} {'precision':>9} {'ckpt':>5} {'stage':>5} {'states':>9} {'step peak':>10} {'ms/step':>8} {'last loss':>10}")
    for r in rows:
        print(f"{r['accum']:5d} {r['precision']:>9} {r['ckpt']:>5} {r['stage']:5d} {r['model_states'] / 1024:9.1f} "
              f"{r['step_peak'] / 1024:10.1f} {r['step_s'] * 1e3:8.1f} {r['loss']:10.6f}")
    write_json(args.json, {}, rows=rows)
    return rows


if __name__ == "__main__":
    main()
