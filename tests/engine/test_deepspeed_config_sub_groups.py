"""DeepSpeed's zero_optimization.sub_group_size (issue 17): the ZeRO optimizer steps each rank's
shard in sub-groups, so the step's temporaries are one sub-group's, and training is unchanged
bit for bit. `pytest -k deepspeed_config_sub_group`."""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn

import tinyscale as ts
from tinyscale import EngineConfig
from tinyscale.checkpointing.measure import peak_bytes
from tinyscale.data import synthetic_regression_batches
from tinyscale.models import TinyMLP
from tinyscale.zero.stage3 import ZeroStage3


def _train(stage, offload, sub_group_size, nvme_dir):
    zero = {"stage": stage, "reduce_bucket_size": 100, "offload_optimizer": {"device": offload, "nvme_path": nvme_dir}}
    if sub_group_size is not None:
        zero["sub_group_size"] = sub_group_size
    engine = ts.initialize(TinyMLP(seed=0), {"train_batch_size": 4, "zero_optimization": zero,
                                             "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}})
    for batch in synthetic_regression_batches(num_batches=2, batch_size=4, dim=8, seed=0):
        engine.train_batch(batch)
    groups = [sum(engine.zero.sharded.fragments[i][k].view.numel() for i, k in g) for g in engine.zero.sharded.sub_groups]
    state = engine.full_state_dict()
    for swap in engine._swappers():  # the disk tier's writes land before its directory goes
        swap.close()
    return state, groups


def _same_training_in_sub_groups(stage):
    out = []
    with tempfile.TemporaryDirectory() as nvme_dir:
        for offload in ("none", "cpu") + (("nvme",) if stage == 3 else ()):  # the disk tier steps per unit
            whole, one = _train(stage, offload, None, nvme_dir)
            pieces, groups = _train(stage, offload, 7, nvme_dir)  # 7: cuts through every parameter
            out.append((offload, len(one), groups, all(torch.equal(whole[k], pieces[k]) for k in whole)))
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_config_sub_group_size_trains_bit_identically(stage):
    from tinyscale.testing import run_on_ranks

    for rank_result in run_on_ranks(_same_training_in_sub_groups, 2, stage):
        for offload, whole_groups, groups, equal in rank_result:
            assert whole_groups == 1 and len(groups) > 10, (offload, groups)  # the default 1e9: one step
            assert max(groups) <= 7 and equal, offload  # torch.equal on every parameter, float64


def _model_and_step_peaks(sub_group_size, foreach):
    torch.manual_seed(0)  # one unit of 2,372 elements: 32x64 and 64x4 weights, their biases
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4)).double()
    zero = ZeroStage3(model.parameters(), lambda g: torch.optim.AdamW(g, lr=1e-2, foreach=foreach), None,
                      module=model, offload_optimizer="cpu", sub_group_size=sub_group_size)
    x = torch.randn(8, 32, dtype=torch.float64)
    peaks = []
    for _ in range(2):
        model(x).pow(2).mean().backward()
        peaks.append(peak_bytes(zero.step))
    return peaks[1]  # step 2: AdamW's states exist, so what the step allocates is temporary


@pytest.mark.parametrize("foreach", [False, True])
def test_deepspeed_config_sub_group_size_bounds_the_offloaded_step_memory(foreach):
    params, total = 4, 2372
    flags = params  # the step's usage flags: one bool per parameter
    # AdamW allocates sqrt(exp_avg_sq) and the denominator: two temporaries of what it steps at
    # once. It steps one flat tensor per unit and sub-group (zero/flat_step.py, as DeepSpeed steps
    # its flat partition): per tensor (foreach False, torch's CPU default) both temporaries are
    # the whole unit; as a list (foreach, the GPU default) the first is, the second in place.
    whole = _model_and_step_peaks(None, foreach)
    assert whole == (2 * 8 * total if not foreach else 8 * total) + flags
    for size in (256, 64):
        assert _model_and_step_peaks(size, foreach) <= 2 * 8 * size + flags < whole


def test_deepspeed_config_sub_group_size_auto_and_stage0():
    zero = EngineConfig.load({"train_batch_size": 4, "zero_optimization": {"stage": 3, "sub_group_size": "auto"}})
    assert zero.zero_optimization.sub_group_size == 10**9  # DeepSpeed's default
    engine = ts.initialize(TinyMLP(seed=0), {"train_batch_size": 4, "zero_optimization": {"sub_group_size": 100}})
    assert any("sub_group_size: no effect at stage 0" in n for n in engine.config_notes)
