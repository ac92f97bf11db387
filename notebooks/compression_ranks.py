"""Rank functions for notebooks/10-compression.ipynb (lesson 10, "Gradient compression").

`tinyscale.dist.launch` starts every rank as a fresh process, which finds a function only
by importing it, so everything that runs on ranks lives here, at module level. Each function
runs on every rank with the same arguments; `launch` returns the values in rank order.

- `train_curves`: the tiny GPT through `ts.initialize` with each `compression` section, the
  same batches, one optimizer; per-step losses and the bytes the comm ledger saw;
- `run_many`: several `train_curves` in one launch (starting ranks costs seconds).
"""

from __future__ import annotations

import torch.distributed as dist

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig


def run_many(calls: list[tuple[dict, dict]]) -> list[dict]:
    """[(runs, optimizer)] -> [train_curves(runs, optimizer)], in one launch."""
    return [train_curves(runs, optimizer) for runs, optimizer in calls]


def train_curves(runs: dict[str, dict], optimizer: dict, steps: int = 30) -> dict[str, dict]:
    """{name: {"loss": [per step], "bytes": total ledger bytes}} for each `compression` section in
    `runs`, training the tiny GPT with the `optimizer` section from the same seed on the same
    batches (rows split over the ranks)."""
    world = dist.get_world_size()
    batches = synthetic_token_batches(num_batches=steps, batch_size=4 * world, seq_len=16, seed=0)
    out = {}
    for name, section in runs.items():
        config = {"train_batch_size": 4 * world, "train_micro_batch_size_per_gpu": 4,
                  "optimizer": optimizer, "compression": section}
        engine = ts.initialize(GPT(GPTConfig.preset("tiny"), seed=0), config)
        losses = [engine.train_batch(b) for b in batches]
        out[name] = {"loss": losses, "bytes": engine.comm_ledger.bytes()}
    return out
