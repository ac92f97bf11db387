"""The single-process reference: the truth. Its own properties, checked without any ranks."""

from __future__ import annotations

import math

import pytest
import torch

from tinyscale import EngineConfig, reference
from tinyscale.data import synthetic_regression_batches, synthetic_token_batches
from tinyscale.models import GPT, GPTConfig, TinyMLP
from tinyscale.optim import lr_at
from tinyscale.testing import assert_state_dicts_close


def _mlp_run(config, steps=4, seed=0):
    model = TinyMLP(seed=seed)
    batches = synthetic_regression_batches(num_batches=steps, batch_size=12, dim=8, seed=seed)
    return reference.train(model, batches, config), model.state_dict()


def test_reference_micro_batching_does_not_change_the_math():
    base = {"train_batch_size": 12, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    losses_one, state_one = _mlp_run({**base, "train_micro_batch_size_per_gpu": 12})
    losses_many, state_many = _mlp_run({**base, "train_micro_batch_size_per_gpu": 3})
    assert losses_one == pytest.approx(losses_many, rel=1e-12)
    assert_state_dicts_close(state_many, state_one)


def test_reference_gradient_clipping_bounds_the_update():
    # SGD without momentum: the update is -lr * clipped gradient. torch's clip_grad_norm_
    # scales by max_norm / (norm + 1e-6), so the update's norm is max_norm * g / (g + 1e-6).
    model, probe = TinyMLP(seed=1), TinyMLP(seed=1)
    before = {k: v.clone() for k, v in model.named_parameters()}
    batches = synthetic_regression_batches(num_batches=1, batch_size=6, dim=8, seed=1)
    probe(*batches[0]).backward()
    g = torch.cat([p.grad.flatten() for p in probe.parameters() if p.grad is not None]).norm().item()
    assert g > 1e-3  # so the clip is active
    reference.train(model, batches, {"train_batch_size": 6, "gradient_clipping": 1e-3,
                                     "optimizer": {"type": "SGD", "params": {"lr": 1.0}}})
    step = torch.cat([(p - before[k]).flatten() for k, p in model.named_parameters()])
    assert step.norm().item() == pytest.approx(1e-3 * g / (g + 1e-6), rel=1e-12)


def test_reference_leaves_frozen_parameters_alone_and_trains_the_rest():
    model = TinyMLP(seed=2)
    frozen = model.frozen.weight.clone()
    losses, _ = _mlp_run({"train_batch_size": 12, "optimizer": {"params": {"lr": 5e-2}}}, steps=30, seed=2)
    reference.train(model, synthetic_regression_batches(num_batches=3, batch_size=12, dim=8, seed=2),
                    {"train_batch_size": 12})
    assert torch.equal(model.frozen.weight, frozen)
    assert losses[-1] < 0.5 * losses[0]


def test_reference_gpt_loss_falls_on_synthetic_tokens():
    cfg = GPTConfig.preset("tiny")
    model = GPT(cfg, seed=0, dtype=torch.float64)
    batches = synthetic_token_batches(num_batches=25, batch_size=4, seq_len=cfg.max_seq_len, seed=0)
    losses = reference.train(model, batches, {"train_batch_size": 4, "optimizer": {"params": {"lr": 1e-2}}})
    assert losses[0] == pytest.approx(math.log(256), rel=0.05)
    assert losses[-1] < losses[0] - 0.5


def test_reference_rejects_batches_of_the_wrong_size():
    with pytest.raises(ValueError, match="has 12 rows but train_batch_size is 8"):
        _mlp_run({"train_batch_size": 8})


def test_reference_lr_schedules_hit_their_endpoints():
    def cfg(kind, **params):
        return EngineConfig.load({"train_batch_size": 1, "optimizer": {"params": {"lr": 1.0}},
                                  "scheduler": {"type": kind, "params": params}})

    warm = cfg("WarmupLR", warmup_num_steps=4, warmup_min_lr=0.2, warmup_max_lr=1.0, warmup_type="linear")
    # DeepSpeed's indexing: step k runs at the formula's value for k - 1, and step 0 at warmup_min_lr
    assert [lr_at(s, warm) for s in range(7)] == pytest.approx([0.2, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0])
    decay = cfg("WarmupDecayLR", warmup_num_steps=2, total_num_steps=6, warmup_max_lr=1.0, warmup_type="linear")
    assert [lr_at(s, decay) for s in range(9)] == pytest.approx([0, 0, 0.5, 1, 0.75, 0.5, 0.25, 0, 0])
    cos = cfg("WarmupCosineLR", warmup_num_steps=1, total_num_steps=10, cos_min_ratio=0.1)  # W 1 warms up as 2
    assert lr_at(0, cos) == 0 and lr_at(1, cos) == 0 and lr_at(2, cos) == pytest.approx(1.0)
    assert lr_at(6, cos) == pytest.approx(0.55) and lr_at(10, cos) == pytest.approx(0.1)
    log = cfg("WarmupLR", warmup_num_steps=9, warmup_max_lr=1.0, warmup_type="log")
    assert lr_at(0, log) == 0 and lr_at(10, log) == 1.0 and 0.5 < lr_at(4, log) < 1.0
    no_schedule = EngineConfig.load({"train_batch_size": 1, "optimizer": {"params": {"lr": 0.3}}})
    assert lr_at(1000, no_schedule) == 0.3
