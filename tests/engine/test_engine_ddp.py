"""The engine's data parallelism trains exactly like one process (float64), on 2, 3 and 4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import tinyscale as ts
from tinyscale.data import synthetic_regression_batches, synthetic_token_batches
from tinyscale.data_parallel import assign_buckets
from tinyscale.models import GPT, GPTConfig, TinyMLP
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks


def _model_and_batches(kind, seed, rows, steps):
    if kind in ("mlp", "mlp-wide"):  # wide: 1.2 MB of float64 gradients, past torch's 1 MiB first bucket
        model = TinyMLP(dim=8, hidden=16 if kind == "mlp" else 384, seed=seed, dtype=torch.float64)
        batches = synthetic_regression_batches(num_batches=steps, batch_size=rows, dim=8, seed=seed)
    else:
        cfg = GPTConfig.preset("tiny")
        model = GPT(cfg, seed=seed, dtype=torch.float64)
        batches = synthetic_token_batches(num_batches=steps, batch_size=rows, seq_len=16, seed=seed)
    return model, batches


def _config(micro, accum, world_size, clip, optimizer):
    opt = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}} if optimizer == "adamw" else \
        {"type": "SGD", "params": {"lr": 5e-2, "momentum": 0.9}}
    return {"train_batch_size": micro * accum * world_size, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accum, "gradient_clipping": clip, "optimizer": opt,
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}


def _train_on_ranks(kind, seed, config, steps):
    rows = ts.EngineConfig.load(config).batch(dist.get_world_size()).train_batch_size
    model, batches = _model_and_batches(kind, seed, rows, steps)
    engine = ts.initialize(model, config)
    losses = [engine.train_batch(b) for b in batches]
    return losses, engine.full_state_dict(), engine.comm_ledger.calls("all_reduce")


def _check_against_reference(kind, seed, config, steps, world_size):
    results = run_on_ranks(_train_on_ranks, world_size, kind, seed, config, steps)
    rows = ts.EngineConfig.load(config).batch(world_size).train_batch_size
    model, batches = _model_and_batches(kind, seed, rows, steps)
    ref_losses = ts.reference.train(model, batches, config)
    for losses, state, _ in results:
        assert_losses_close(losses, ref_losses)
        assert_state_dicts_close(state, model.state_dict(), what="parameters after training")
    # Ranks apply identical updates to identical gradients: bitwise equal, not merely close.
    for _, state, _ in results[1:]:
        assert all(torch.equal(state[k], results[0][1][k]) for k in state)
    return results


@given(world_size=st.sampled_from([2, 3, 4]), seed=st.integers(0, 2**16), micro=st.integers(1, 3),
       accum=st.integers(1, 3), clip=st.sampled_from([0.0, 0.05, 10.0]), optimizer=st.sampled_from(["adamw", "sgd"]))
def test_ddp_engine_matches_single_process_float64(world_size, seed, micro, accum, clip, optimizer):
    _check_against_reference("mlp", seed, _config(micro, accum, world_size, clip, optimizer), 3, world_size)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ddp_engine_gpt_matches_single_process_float64(world_size):
    config = _config(micro=1, accum=2, world_size=world_size, clip=1.0, optimizer="adamw")
    results = _check_against_reference("gpt", 7, config, 3, world_size)  # 2 warm-up steps, step 0 at lr 0
    # One all-reduce per gradient bucket plus one for the loss, every step. The buckets: torch's
    # layout, a first of at most 1 MiB, the rest of reduce_bucket_size (default 5e8 elements).
    # This GPT's float64 gradients are 328,960 bytes, under 1 MiB: the first bucket holds them all.
    trainable = [p for p in GPT(GPTConfig.preset("tiny")).parameters() if p.requires_grad]
    n_buckets = len(assign_buckets(trainable, 500_000_000 * 8, first_cap_bytes=2**20))
    assert n_buckets == 1
    assert results[0][2] == 3 * (n_buckets + 1)


@pytest.mark.parametrize("overlap", [True, False])
def test_ddp_engine_first_bucket_is_torchs_1_mib_when_it_overlaps(overlap):
    """ZeRO 0 buckets as torch's DDP: the first to fill (the last layers) of at most 1 MiB, so its
    all-reduce starts early in backward, the rest of reduce_bucket_size; without overlap_comm
    every bucket waits for the end of backward anyway, and the first is not split off."""
    config = {**_config(micro=1, accum=2, world_size=2, clip=0.0, optimizer="sgd"),
              "zero_optimization": {"stage": 0, "overlap_comm": overlap}}
    results = _check_against_reference("mlp-wide", 3, config, 2, 2)
    trainable = [p for p in TinyMLP(hidden=384).parameters() if p.requires_grad]
    # float64, last registered first (frozen.* excluded): shared.bias (384 elements) holds less
    # than 1 MiB (131,072 elements), so shared.weight (147,456) goes in too and the first bucket
    # closes (torch's rule: the parameter crossing the cap goes in); fc_in.bias, fc_in.weight and
    # out_bias go in the second (5e8 elements). So 2 buckets with overlap_comm, 1 without.
    n_buckets = 2 if overlap else 1
    assert len(assign_buckets(trainable, 500_000_000 * 8, first_cap_bytes=2**20 if overlap else None)) == n_buckets
    assert results[0][2] == 2 * (n_buckets + 1)


def test_ddp_engine_buckets_follow_reduce_bucket_size():
    config = {**_config(micro=1, accum=1, world_size=2, clip=0.0, optimizer="sgd"),
              "zero_optimization": {"stage": 0, "reduce_bucket_size": 250}}  # elements
    results = _check_against_reference("mlp", 1, config, 2, 2)
    trainable = [p for p in TinyMLP().parameters() if p.requires_grad]
    n_buckets = len(assign_buckets(trainable, 250 * 8))  # float64: 8 bytes per element
    assert n_buckets > 1 and results[0][2] == 2 * (n_buckets + 1)


def _ledger_and_memory(world_size_unused):
    model, batches = _model_and_batches("mlp", 0, 2 * dist.get_world_size(), 1)
    engine = ts.initialize(model, {"train_micro_batch_size_per_gpu": 2})
    engine.train_batch(batches[0])
    trainable = [p for p in model.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    report = engine.memory_report()
    grad_bytes += len(trainable) * trainable[0].element_size()  # usage flags, one per parameter, in the last bucket
    return engine.comm_ledger.bytes("all_reduce"), grad_bytes, report.as_dict(), trainable[0].dtype


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_engine_ledger_and_memory_report_count_what_is_held(world_size):
    for allreduce_bytes, grad_bytes, memory, dtype in run_on_ranks(_ledger_and_memory, world_size, world_size):
        # every gradient once and the usage flags; the float64 loss and a failed-step flag per rank
        assert allreduce_bytes == grad_bytes + 8 * (1 + world_size)
        model = TinyMLP(dim=8, hidden=16)
        param_bytes = sum(p.numel() * 8 for p in model.parameters())  # tied weight counted once
        n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        n_tensors = len([p for p in model.parameters() if p.requires_grad])
        assert memory["parameters"] == param_bytes
        assert memory["gradients"] == 0  # zero_grad(set_to_none=True) after the step
        # AdamW: exp_avg and exp_avg_sq per trainable element, plus one scalar `step` tensor per parameter.
        step_bytes = torch.tensor(0.0).element_size()
        assert memory["optimizer_states"] == 2 * 8 * n_trainable + n_tensors * step_bytes


def test_ddp_engine_single_process_without_a_process_group():
    model, batches = _model_and_batches("mlp", 3, 6, 2)
    engine = ts.initialize(model, {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2})
    losses = [engine.train_batch(b) for b in batches]
    ref_model, _ = _model_and_batches("mlp", 3, 6, 2)
    assert_losses_close(losses, ts.reference.train(ref_model, batches, {"train_batch_size": 6}))
    with pytest.raises(ValueError, match="has 4 rows but train_batch_size is 6"):
        engine.train_batch(tuple(t[:4] for t in batches[0]))
