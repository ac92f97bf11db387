"""Rank functions for notebooks/13-moe.ipynb (lesson 13, "Mixture of experts and expert parallelism").

`tinyscale.dist.launch` starts every rank as a fresh process, which finds a function only by
importing it, so everything that runs on ranks lives here, at module level.

- `all_to_all_ledger`: one MoE layer with its experts split over the world, forward and
  backward on this rank's tokens; the ledger's all-to-all rows and the routing counts;
- `engine_losses`: an MoE GPT trained by the engine at a given `parallel.expert`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.dist import comm
from tinyscale.models import GPT, GPTConfig
from tinyscale.moe import MoE, apply_expert_parallel


def all_to_all_ledger(experts: int, top_k: int, capacity_factor: float, tokens: int) -> dict:
    cfg = GPTConfig.preset("tiny").with_(moe_experts=experts, moe_top_k=top_k, moe_capacity_factor=capacity_factor)
    layer = MoE(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    apply_expert_parallel(layer, dist.group.WORLD)
    x = torch.randn(1, tokens, cfg.d_model, generator=torch.Generator().manual_seed(dist.get_rank()))
    x.requires_grad_(True)  # as in a model: the tokens' gradient goes back through the dispatch
    with comm.record() as ledger:
        layer(x).sum().backward()
    return {"rows": [(r.op, r.dtype, r.bytes) for r in ledger.rows if r.op == "all_to_all"],
            "kept": layer.stats.kept.tolist(), "local": layer.experts.local, "dropped": layer.stats.dropped}


def engine_losses(ep: int, steps: int) -> list[float]:
    cfg = GPTConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=4, d_model=32, moe_experts=4, moe_top_k=2,
                    moe_capacity_factor=1.0)
    world = dist.get_world_size()
    engine = ts.initialize(GPT(cfg, seed=0, dtype=torch.float64),
                           {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2,
                            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "parallel": {"expert": ep}})
    batches = synthetic_token_batches(num_batches=steps, batch_size=2 * world, seq_len=16, vocab_size=64, seed=0)
    return [engine.train_batch(b) for b in batches]
