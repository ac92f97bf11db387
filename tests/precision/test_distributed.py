"""Overflow is decided together: an inf on one rank makes every rank skip and back off.

Two situations. Ranks whose gradients differ (ZeRO shards, tensor- or pipeline-parallel
pieces, or a check placed before the gradient all-reduce) must agree explicitly: that is
`found_overflow`'s all-reduce MAX, and the control case shows what happens without it. Under
data parallelism the all-reduce of the gradients already spreads an inf (inf + x = inf; nan
stays nan), and the flag's all-reduce keeps the answer the same on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tinyscale.data import shard_rows, synthetic_token_batches
from tinyscale.data_parallel import NaiveDDP
from tinyscale.dist import comm
from tinyscale.models import GPT, GPTConfig
from tinyscale.precision import (
    IMPLEMENTATIONS,
    DynamicLossScaler,
    MixedPrecisionOptimizer,
)
from tinyscale.testing import implementations, resolve, run_on_ranks

SCALERS = implementations("mixed_precision_scaler", IMPLEMENTATIONS)
BAD_VALUES = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}


def flag_body(impl):
    """For every choice of bad rank (or none) and bad value: what this rank concluded."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for bad_rank in [None, *range(world)]:
        for kind, value in BAD_VALUES.items():
            scaler = resolve(impl)(initial_scale_power=8, hysteresis=1)
            grads = [torch.randn(5, 3, dtype=torch.float16), None, torch.randn(7)]
            if rank == bad_rank:
                grads[2][rank] = value
            with comm.record() as ledger:
                overflow = scaler.found_overflow(grads, None)
            skipped = scaler.update(overflow)
            out.append((bad_rank, kind, overflow, skipped, scaler.scale, ledger.calls("all_reduce"),
                        ledger.bytes("all_reduce")))
    return out


@pytest.mark.parametrize("impl", SCALERS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_mixed_precision_inf_on_one_rank_makes_every_rank_skip(impl, world_size):
    per_rank = run_on_ranks(flag_body, world_size, impl)
    for cases in zip(*per_rank):  # the same case, as each rank saw it
        bad_rank, kind = cases[0][:2]
        expected = (bad_rank is not None, bad_rank is not None, 2.0**7 if bad_rank is not None else 2.0**8)
        for rank, (_, _, overflow, skipped, scale, calls, nbytes) in enumerate(cases):
            assert (overflow, skipped, scale) == expected, (rank, bad_rank, kind)
            assert (calls, nbytes) == (1, 4), "one all-reduce of one float32 flag per check"


def _fp16_tiny_gpt(group, seed=0):
    model = GPT(GPTConfig.preset("tiny"), seed=seed)
    mp = MixedPrecisionOptimizer(model.parameters(), lambda g: torch.optim.AdamW(g, lr=1e-3), dtype=torch.float16,
                                 loss_scaler=DynamicLossScaler(initial_scale_power=8, hysteresis=1),
                                 process_group=group)
    return model, mp


def different_grads_body(bad_rank, agree):
    """Each rank trains on its own rows without averaging (its gradients differ, as ZeRO shards or
    model-parallel pieces do); `bad_rank` gets an inf at step 1. agree=False gives every rank a
    group of its own, so nobody hears about anyone else's overflow: the control."""
    rank, world = dist.get_rank(), dist.get_world_size()
    own = [dist.new_group([r]) for r in range(world)]  # every rank takes part in creating each group
    model, mp = _fp16_tiny_gpt(None if agree else own[rank])
    skipped, moved = [], []
    for k, batch in enumerate(synthetic_token_batches(num_batches=3, batch_size=world, seq_len=8, seed=0)):
        before = [p.detach().clone() for p in model.parameters()]
        mp.backward(model(*shard_rows(batch, rank, world)))
        if k == 1 and rank == bad_rank:
            model.head.weight.grad[0, 0] = float("inf")
        skipped.append(mp.step())
        mp.zero_grad()
        moved.append(any(not torch.equal(a, b) for a, b in zip(before, model.parameters())))
    return skipped, moved, mp.loss_scale


@pytest.mark.parametrize("world_size", [2, 4])
def test_mixed_precision_optimizer_ranks_with_different_grads_skip_together(world_size):
    bad_rank = world_size - 1
    for skipped, moved, scale in run_on_ranks(different_grads_body, world_size, bad_rank, True):
        assert skipped == [False, True, False] and moved == [True, False, True]
        assert scale == 2.0**7
    # The control: without the agreement only the bad rank skips, and the ranks' steps (and
    # their loss scales) part ways: the state ZeRO or tensor parallelism cannot survive.
    control = run_on_ranks(different_grads_body, world_size, bad_rank, False)
    assert [c[0][1] for c in control] == [r == bad_rank for r in range(world_size)]
    assert len({c[2] for c in control}) == 2


def ddp_body(dtype_name, bad_rank):
    """Data parallelism: NaiveDDP all-reduces the fp16/bf16 gradients; `bad_rank`'s gradient gets
    an inf at step 1 *before* that all-reduce (a hook), as a bad batch would."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    model = GPT(GPTConfig.preset("tiny"), seed=0)
    scaler = DynamicLossScaler(initial_scale_power=8, hysteresis=1) if dtype == torch.float16 else None
    # The cast happens in the optimizer's constructor: build it before the DDP wrapper.
    mp = MixedPrecisionOptimizer(model.parameters(), lambda g: torch.optim.SGD(g, lr=0.1), dtype=dtype,
                                 loss_scaler=scaler, process_group=None)
    ddp = NaiveDDP(model)
    step = {"k": 0}
    if rank == bad_rank:
        model.head.weight.register_hook(lambda g: g.fill_(float("inf")) if step["k"] == 1 else g)
    skipped, losses = [], []
    with comm.record() as ledger:
        for k, batch in enumerate(synthetic_token_batches(num_batches=4, batch_size=2 * world, seq_len=8, seed=0)):
            step["k"] = k
            loss = ddp(*shard_rows(batch, rank, world))
            mp.backward(loss)
            skipped.append(mp.step())
            mp.zero_grad()
            losses.append(loss.item())
    grad_dtypes = {r.dtype for r in ledger.rows if r.op == "all_reduce" and r.bytes > 4}
    return skipped, [p.detach().clone() for p in model.parameters()], grad_dtypes


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_mixed_precision_with_ddp_replicas_stay_identical(dtype_name):
    bad_rank = 1 if dtype_name == "float16" else None  # bf16 has no scaler: nothing to skip
    results = run_on_ranks(ddp_body, 2, dtype_name, bad_rank)
    expected_skips = [False, True, False, False] if bad_rank is not None else [False] * 4
    for skipped, params, grad_dtypes in results:
        assert skipped == expected_skips
        assert grad_dtypes == {dtype_name}  # the gradients travel in the low format: half the bytes
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][1]))
