"""The engine's fp16/bf16 (`pytest -k mixed_precision`): every ZeRO stage computes what stage
0 computes, bit for bit; an overflow on one rank skips the step on all; resuming is exact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import run_on_ranks

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}}


def _model(seed):
    # d_model 20: sizes that divide neither 3 nor 4; fp32 parameters, rounded by the engine
    cfg = GPTConfig(vocab_size=256, max_seq_len=16, n_layer=2, n_head=5, d_model=20, ffn_hidden=36)
    return GPT(cfg, seed=seed, dtype=torch.float32)


def _config(stage, precision, world, accum=1, extra=None):
    return {"train_batch_size": 2 * accum * world, "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": accum, "optimizer": ADAMW, precision: {"enabled": True, **(extra or {})},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300}}


def _train(stage, precision, steps, inject_at=None, save=None, load=None):
    world = dist.get_world_size() if dist.is_initialized() else 1
    engine = ts.initialize(_model(0), _config(stage, precision, world))
    batches = synthetic_token_batches(num_batches=steps, batch_size=2 * world, seq_len=16, seed=0)
    if inject_at is not None:  # the overflowing step is retried on the same batch
        batches.insert(inject_at, batches[inject_at])
    if load:
        engine.load_checkpoint(load)
    scales, losses = [], []
    for step in range(engine.step, len(batches)):
        handle = None
        if step == inject_at and (not dist.is_initialized() or dist.get_rank() == world - 1):
            # an inf in one gradient on one rank only (the last): every rank must skip
            handle = engine.model.embed.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        losses.append(engine.train_batch(batches[step]))
        if handle is not None:
            handle.remove()
        scales.append(engine.loss_scaler.scale if engine.loss_scaler else None)
        if save and step + 1 == save[1]:
            engine.save_checkpoint(save[0])
    state = engine.full_state_dict()
    return losses, state, scales, engine.skipped_steps, {v.dtype for v in state.values() if v.is_floating_point()}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("world", [1, 2])
def test_mixed_precision_every_zero_stage_is_bit_identical_to_stage_0(precision, world):
    # With 2 ranks a sum over ranks is one addition (a + b == b + a, exactly), halving is
    # exact, and with one micro-batch and no clipping nothing else differs between stages:
    # equality, not closeness, is the right test.
    run = (lambda *a: [_train(*a)]) if world == 1 else (lambda *a: run_on_ranks(_train, world, *a))
    baseline = run(0, precision, 3)
    low = torch.float16 if precision == "fp16" else torch.bfloat16
    for stage in (1, 2, 3):
        for (losses, state, scales, _, dtypes), (ref_losses, ref_state, ref_scales, _, _) in zip(
                run(stage, precision, 3), baseline):
            assert dtypes == {low}, stage  # the model computes in fp16/bf16 ...
            assert losses == ref_losses, stage
            assert scales == ref_scales, stage
            assert all(torch.equal(state[k], ref_state[k]) for k in state), stage


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_mixed_precision_overflow_on_one_rank_skips_the_step_on_every_rank(stage):
    plain = run_on_ranks(_train, 2, stage, "fp16", 2)
    skipped = run_on_ranks(_train, 2, stage, "fp16", 2, 0)  # step 0 overflows on rank 1, then as plain
    for (_, state, scales, skips, _), (_, ref_state, ref_scales, ref_skips, _) in zip(skipped, plain):
        assert skips == 1 and ref_skips == 0
        # DeepSpeed's defaults: 2^16, hysteresis 2, so the first overflow only uses up hysteresis
        assert scales[0] == ref_scales[0] == 2.0**16
        # the skipped step changed nothing: the next two steps are the plain run's two
        assert all(torch.equal(state[k], ref_state[k]) for k in state)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_mixed_precision_checkpoint_resumes_bit_for_bit(tmp_path, stage):
    path = str(tmp_path / "ckpt")
    straight = run_on_ranks(_train, 2, stage, "fp16", 4, None, (path, 2))
    resumed = run_on_ranks(_train, 2, stage, "fp16", 4, None, None, path)
    for (losses, state, scales, _, _), (r_losses, r_state, r_scales, _, _) in zip(straight, resumed):
        assert r_losses == losses[2:] and r_scales == scales[2:]
        assert all(torch.equal(state[k], r_state[k]) for k in state)
