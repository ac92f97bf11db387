"""Every micro-batch is a view of the global batch (`tinyscale.data.split`): a view kept past the
step keeps the whole global batch's storage alive. No engine path keeps one (`pytest -k data_split`).

The pipeline executor kept its last run's micro-batch ids and targets (`PipelineExecutor.inputs`,
`.targets`) until the next step: the previous global batch lived beside the current one. Each
case here trains 2 steps on 2 ranks and, after each `train_batch`, holds only a weak reference
to the batch's tensors' storages: it must be dead at once (by reference counting, no garbage
collection), on every rank. The cases cover what could hold one: counter dropout's clock and
its mask skipping (dp with ZeRO 3, tp), the pipeline's schedules (1F1B, ZB-H1), accumulation
in all of them, and the monitor (`wall_clock_breakdown`).
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import run_on_ranks

MICRO, ACCUM, STEPS = 2, 2, 2
CASES = {  # name: (parallel, zero stage)
    "dp2-zero3": ({}, 3),
    "tp2": ({"tensor": 2}, 1),
    "pp2-1f1b": ({"pipeline": 2}, 0),
    "pp2-zb_h1": ({"pipeline": 2, "pipeline_schedule": "zb_h1"}, 2),
}


def _alive_after_each_step(name: str) -> list[list[bool]]:
    parallel, stage = CASES[name]
    dp = dist.get_world_size() // (parallel.get("tensor", 1) * parallel.get("pipeline", 1))
    cfg = GPTConfig(vocab_size=61, max_seq_len=10, n_layer=2, n_head=4, n_kv_head=2, d_model=16, ffn_hidden=24,
                    dropout=0.1, dropout_masks="counter")
    config = {"train_batch_size": MICRO * ACCUM * dp, "train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": ACCUM, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage}, "parallel": parallel, "wall_clock_breakdown": True}
    engine = ts.initialize(GPT(cfg, seed=1, dtype=torch.float64), config)
    alive = []
    for b in synthetic_token_batches(num_batches=STEPS, batch_size=MICRO * ACCUM * dp, seq_len=10, vocab_size=61,
                                     seed=3):
        batch = tuple(t.clone() for t in b)  # storages of their own: the list `b` came from holds others
        storages = [weakref.ref(t.untyped_storage()) for t in batch]
        engine.train_batch(batch)
        del batch
        alive.append([s() is not None for s in storages])
    return alive


@pytest.mark.parametrize("name", list(CASES))
def test_data_split_views_do_not_outlive_the_step(name):
    for rank, alive in enumerate(run_on_ranks(_alive_after_each_step, 2, name)):
        assert alive == [[False, False]] * STEPS, \
            f"{name}, rank {rank}: the global batch's (ids, targets) storages still alive after each step: {alive}"
