"""The engine's per-step bookkeeping, made cheaper, keeps its rules: a step trains in training
mode whatever mode the model was left in (the engine calls `model.train()` only when some module
is not training: `Engine._step`)."""

from __future__ import annotations

import pytest
import torch

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig


@pytest.mark.parametrize("left_in_eval", ["model", "one block"])
def test_engine_step_trains_in_training_mode_after_eval(left_in_eval):
    cfg = GPTConfig.preset("tiny")
    batches = synthetic_token_batches(num_batches=2, batch_size=2, seq_len=8, seed=0)
    engine = ts.initialize(GPT(cfg, seed=0, dtype=torch.float64),
                           {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.train_batch(batches[0])
    (engine.model if left_in_eval == "model" else next(iter(engine.model.children()))).eval()
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, _: seen.append(m.training)) for m in engine.model.modules()]
    engine.train_batch(batches[1])
    for h in hooks:
        h.remove()
    assert seen and all(seen), "a module ran the step's forward in eval mode"
