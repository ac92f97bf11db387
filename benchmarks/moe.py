"""An MoE GPT with expert parallelism against a dense GPT of equal active FLOPs, same run.

Answers DT-6 (lesson 13): what an expert-parallel step costs beside the dense step that does
the same matmul work per token. Three layouts on N CPU ranks, float32, AdamW, the same tokens:

- dense: the GPT with ffn_hidden = k x the expert width, so each token's feed-forward FLOPs
  equal the MoE's (plus the router's 2CE, which the table counts: `tinyscale.mfu`);
- MoE, ep 1: E experts replicated on every rank, data parallel only (no all-to-all);
- MoE, ep N: the experts split over the N ranks, tokens dispatched and combined by all-to-all.

Per layout: parameters, forward FLOPs per token (tinyscale.mfu), the median step time, tokens
per second, and the all-to-all bytes per step (the ledger; each equals the routing counts:
`pytest -k expert_parallel`). torch has no MoE layer or expert-parallel module to compare
with (its `_grouped_mm` is CUDA only), so the dense model is the baseline.

    .venv/bin/python benchmarks/moe.py [--world-size 2] [--experts 4] [--steps 6] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import tinyscale as ts
from tinyscale.data import sample_batches, stdlib_corpus
from tinyscale.mfu import forward_flops
from tinyscale.models import GPT, GPTConfig

ROWS_PER_RANK, SEQ = 4, 128


def configs(experts: int, top_k: int) -> dict[str, tuple[GPTConfig, int]]:
    base = GPTConfig.preset("small").with_(max_seq_len=SEQ)
    moe = base.with_(moe_experts=experts, moe_top_k=top_k, moe_capacity_factor=1.25)
    dense = base.with_(ffn_hidden=top_k * moe.expert_dim)  # the same expert matmuls per token
    return {"dense": (dense, 1), "moe ep 1": (moe, 1), "moe ep N": (moe, 0)}


def run_rank(experts: int, top_k: int, steps: int) -> list[dict] | None:
    torch.set_num_threads(1)  # ranks share the machine's cores
    world = ts.dist.world_size()
    batches = sample_batches(stdlib_corpus("train").tokens, num_batches=steps + 1, batch_size=ROWS_PER_RANK * world,
                             seq_len=SEQ, seed=0)
    rows = []
    for name, (cfg, ep) in configs(experts, top_k).items():
        ep = ep or world
        engine = ts.initialize(GPT(cfg, seed=0), {"train_micro_batch_size_per_gpu": ROWS_PER_RANK,
                                                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                                 "parallel": {"expert": ep}})
        engine.train_batch(batches[0])  # warm-up: the optimizer's states, the first allocation
        times, a2a = [], []
        for b in batches[1:]:
            engine.comm_ledger.clear()
            start = time.perf_counter()
            engine.train_batch(b)
            times.append(time.perf_counter() - start)
            a2a.append(engine.comm_ledger.bytes("all_to_all"))
        seconds = statistics.median(times)
        rows.append({"layout": name.replace(" N", f" {world}"), "params": cfg.num_params(),
                     "flops_per_token": forward_flops(cfg, SEQ).forward // SEQ, "step_s": seconds,
                     "tokens_per_s": ROWS_PER_RANK * world * SEQ / seconds,
                     "all_to_all_bytes": statistics.median(a2a),
                     "dropped": engine.last_step.get("moe", {}).get("dropped", 0)})
    return rows if ts.dist.rank() == 0 else None


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = ts.dist.launch(run_rank, args.world_size, args.experts, args.top_k, args.steps, timeout_s=1800)[0]
    print(f"small GPT, {args.experts} experts top-{args.top_k} (capacity 1.25) vs dense of equal active FLOPs; "
          f"{args.world_size} CPU ranks x {ROWS_PER_RANK} rows x {SEQ} tokens, float32, median of {args.steps} steps")
    print(f"{'layout':>10} {'params':>11} {'fwd FLOP/token':>15} {'step':>9} {'tokens/s':>9} {'all-to-all/step':>16}")
    for r in rows:
        print(f"{r['layout']:>10} {r['params']:11,d} {r['flops_per_token']:15,d} {r['step_s'] * 1e3:6.0f} ms "
              f"{r['tokens_per_s']:9.0f} {r['all_to_all_bytes']:14,.0f} B")
    dense = rows[0]["step_s"]
    print("step time / dense: " + ", ".join(f"{r['layout']} {r['step_s'] / dense:.2f}" for r in rows[1:]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "moe", "world_size": args.world_size, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
