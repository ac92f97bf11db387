"""Rank functions for notebooks/12-engine.ipynb (lesson 12, "The engine": composing the layouts).

`tinyscale.dist.launch` starts every rank as a fresh process, which finds a function only by
importing it, so everything that runs on ranks lives here, at module level. What they return:

- `placement_rows`: `tinyscale.engine.plan.placements(engine)` on this rank, as plain rows
  (where every parameter lives: its tp split or copy, its pipeline stages, what this rank counts);
- `costs`: per layout, one step's model-state bytes on this rank (`engine.memory_report`) and its
  communication split by mesh axis (`tinyscale.engine.plan.traffic_by_axis`), measured as
  tests/engine/test_layout_costs.py measures them (the second step: Adam's states exist).

`run_many` runs several of them in one launch (starting ranks costs seconds).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.engine.plan import placements, traffic_by_axis
from tinyscale.models import GPT, GPTConfig

MODEL_STATES = ("parameters", "gradients", "master_weights", "optimizer_states")


def placement_rows(gpt_config: GPTConfig, config: dict) -> list[dict]:
    """Where each parameter this rank holds lives, after the engine's transforms (no step needed)."""
    engine = ts.initialize(GPT(gpt_config, seed=3, dtype=torch.float64), config)
    mesh = engine.mesh.layout.coords(dist.get_rank())
    return [{"rank": dist.get_rank(), "pp": mesh["pp"], "tp": mesh["tp"], "name": p.name,
             "global_shape": p.global_shape, "local_shape": p.local_shape, "split": p.tp, "tp_range": p.tp_range,
             "tp_dim": p.tp_dim, "stages": p.stages, "counted": p.counted_elements}
            for p in placements(engine).values()]


def costs(gpt_config: GPTConfig, configs: list[dict], seq_len: int, vocab: int) -> list[tuple[dict, dict]]:
    """Per config: (model-state bytes of this rank, {axis: {op: {calls, bytes, bus_bytes}}}) of the second step."""
    out = []
    for config in configs:
        engine = ts.initialize(GPT(gpt_config, seed=3, dtype=torch.float64), config)
        for batch in synthetic_token_batches(num_batches=2, batch_size=engine.batch.train_batch_size,
                                             seq_len=seq_len, vocab_size=vocab, seed=1):
            engine.comm_ledger.clear()
            engine.train_batch(batch)
        report = engine.memory_report(when="before_step").as_dict()
        out.append(({k: report[k] for k in MODEL_STATES}, traffic_by_axis(engine.comm_ledger, engine.mesh)))
    return out


def run_many(calls: list[tuple[str, tuple]]) -> list:
    """Run several of this module's functions in one launch: [(name, args)] -> [result]."""
    return [globals()[name](*args) for name, args in calls]
