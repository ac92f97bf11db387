"""What storing experts sharded saves: expert bytes held per rank and the expert gradients' traffic.

Lesson 13, "Experts stored sharded". An MoE GPT (2 layers, every block MoE with 8 experts of
width 64, d_model 32, top-2, float32) trained one step by the engine on dp 4 ranks at ep 1 (every
rank stores all 8 experts; their gradients are reduced over dp like any parameter) and at ep 2
(each rank stores its 4; their gradients are reduced over the 2 ranks holding the same experts),
at ZeRO stages 0, 1 and 3. Per layout, rank 0's: bytes of expert parameters it stores, the
model-state parameter and gradient bytes (`memory_report(when="before_step")`), and the ledger's
bytes and bus bytes (the ring's per-rank traffic) of all-reduce, reduce-scatter and all-gather
by group size (4: dp, 2: the expert-data-parallel group). The all-to-all is left out (lesson 13
counts it against the routing).

    .venv/bin/python benchmarks/moe_expert_bytes.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import run_on_ranks

CFG = GPTConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, ffn_hidden=64,
                moe_experts=8, moe_top_k=2, moe_capacity_factor=1.25)
OPS = ("all_reduce", "reduce_scatter", "all_gather")


def _one(stage: int, ep: int) -> dict:
    engine = ts.initialize(GPT(CFG, seed=1, dtype=torch.float32), {
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage},
        "parallel": {"expert": ep}})
    engine.comm_ledger.clear()  # the step's traffic, not the initial broadcast
    for batch in synthetic_token_batches(num_batches=1, batch_size=8, seq_len=16, vocab_size=64, seed=0):
        engine.train_batch(batch)
    held = sum(torch.Size(s).numel() for n, s in engine._tp_shapes.items() if ".experts." in n) * 4
    traffic: dict[str, list] = {}
    for r in engine.comm_ledger.rows:
        if r.op in OPS:
            t = traffic.setdefault(f"{r.op}@{r.group_size}", [0, 0.0])
            t[0], t[1] = t[0] + r.bytes, t[1] + r.bus_bytes
    report = engine.memory_report(when="before_step")
    return {"stage": stage, "ep": ep, "expert_bytes": held, "parameters": report.bytes("parameters"),
            "gradients": report.bytes("gradients"), "traffic": traffic}


def _all() -> list[dict]:
    return [_one(stage, ep) for stage in (0, 1, 3) for ep in (1, 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = run_on_ranks(_all, 4, timeout_s=600)[0]
    print(f"{'ZeRO':>4} {'ep':>2} {'experts B':>10} {'params B':>9} {'grads B':>8}  traffic (op@group: bytes / bus bytes)")
    for row in rows:
        traffic = ", ".join(f"{k}: {v[0]} / {v[1]:.0f}" for k, v in sorted(row["traffic"].items()))
        print(f"{row['stage']:>4} {row['ep']:>2} {row['expert_bytes']:>10} {row['parameters']:>9} "
              f"{row['gradients']:>8}  {traffic}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
