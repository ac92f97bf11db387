"""Rank functions for notebooks/04-mixed-precision.ipynb (lesson 4, "Mixed precision").

`tinyscale.dist.launch` starts every rank as a fresh process, and a fresh process finds a
function only by importing it, so what runs on ranks lives here, at module level.

- `skip_together`: every rank trains its own copy of the tiny GPT in fp16 on its own rows
  (gradients that differ between ranks, as ZeRO shards or model-parallel pieces do); one rank
  gets an inf at one step. With the overflow flag agreed over the group, every rank skips that
  step; with a group of its own per rank (agree=False), only the unlucky one does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tinyscale.data import shard_rows, synthetic_token_batches
from tinyscale.dist import comm
from tinyscale.models import GPT, GPTConfig
from tinyscale.precision import DynamicLossScaler, MixedPrecisionOptimizer


def skip_together(bad_rank: int, bad_step: int, steps: int, agree: bool = True) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    own_groups = [dist.new_group([r]) for r in range(world)]  # collective: every rank creates each
    model = GPT(GPTConfig.preset("tiny"), seed=0)
    mp = MixedPrecisionOptimizer(model.parameters(), lambda g: torch.optim.AdamW(g, lr=1e-3),
                                 dtype=torch.float16,
                                 loss_scaler=DynamicLossScaler(initial_scale_power=12, loss_scale_window=3),
                                 process_group=None if agree else own_groups[rank])
    batches = synthetic_token_batches(num_batches=steps, batch_size=world, seq_len=16, seed=0)
    scales, skipped = [], []
    with comm.record() as ledger:
        for k, batch in enumerate(batches):
            mp.backward(model(*shard_rows(batch, rank, world)))
            if k == bad_step and rank == bad_rank:
                model.head.weight.grad[0, 0] = float("inf")
            scales.append(mp.loss_scale)
            skipped.append(mp.step())
            mp.zero_grad()
    return {"scales": scales, "skipped": skipped, "flag_allreduces": ledger.calls("all_reduce"),
            "flag_bytes": ledger.bytes("all_reduce")}
