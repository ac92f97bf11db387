"""Data parallelism, one suite for NaiveDDP, BucketedDDP and torch's DistributedDataParallel.

Every implementation is reached through the seam (`IMPLEMENTATIONS`; a learner's file joins
with TINYSCALE_IMPL_DDP=file.py:Class) and held to the same property: trained on shards of
the global batch, with gradient accumulation under `no_sync`, it ends with the parameters
one process gets on the whole batch (float64, rtol 1e-10), on 2, 3 and 4 ranks.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import tinyscale as ts
from tests.zero.test_unused import UnusedMLP
from tinyscale.data import local_micro_batches, synthetic_regression_batches, synthetic_token_batches
from tinyscale.data_parallel import IMPLEMENTATIONS, BucketedDDP
from tinyscale.dist import comm
from tinyscale.models import GPT, GPTConfig, TinyMLP
from tinyscale.optim import build_optimizer
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, implementations, resolve, run_on_ranks

DDP = implementations("ddp", IMPLEMENTATIONS)
OURS = [p for p in DDP if p.id != "torch"]
# Both optimizers, always: Adam's update m / sqrt(v) barely changes when every gradient is
# scaled by the same factor (only through eps and weight decay), so with Adam a DDP that
# forgets to divide by the world size is off by ~1e-8 at most here, a margin no float32
# test could see. SGD's update is proportional to the gradient and exposes it plainly.
OPTIMIZERS = {
    "adamw": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "sgd": {"type": "SGD", "params": {"lr": 5e-2, "momentum": 0.9}},
}


def wrap(impl: str, model, bucket_cap_mb=None, **kwargs):
    cls = resolve(impl)
    if bucket_cap_mb is not None and "bucket_cap_mb" in inspect.signature(cls).parameters:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    return cls(model, **kwargs)


class HeadFirstMLP(torch.nn.Module):
    """TinyMLP (a tied, a shared and a frozen layer) under a `head` that is registered first and
    applied last: its gradients arrive first in backward, but buckets go in reverse registration
    order, so the bucket that fills first is the last one, and the others fill out of order."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.head = torch.nn.Linear(8, 8, dtype=torch.float64)
        self.body = TinyMLP(seed=seed)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed)
            for p in self.head.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / 4)

    def forward(self, x, y):
        b = self.body
        h = torch.tanh(b.shared(torch.tanh(b.frozen(torch.tanh(b.shared(torch.tanh(b.fc_in(x))))))))
        return torch.mean((self.head(h @ b.fc_in.weight + b.out_bias) - y) ** 2)


def _model_and_batches(kind, seed, rows, steps, uses=None):
    if kind == "mlp-unused":  # a layer no forward uses, and one used by the rows in uses[step]
        batches = []
        for step, (x, y) in enumerate(synthetic_regression_batches(num_batches=steps, batch_size=rows, dim=8,
                                                                   seed=seed)):
            x = x.clamp(-3, 3)
            x[[r % rows for r in uses[step]], 0] = 10.0  # these rows use UnusedMLP.extra
            batches.append((x, y))
        return UnusedMLP(seed=seed), batches
    if kind == "mlp-head-first":
        return (HeadFirstMLP(seed=seed),
                synthetic_regression_batches(num_batches=steps, batch_size=rows, dim=8, seed=seed))
    if kind == "mlp":
        return (TinyMLP(seed=seed),
                synthetic_regression_batches(num_batches=steps, batch_size=rows, dim=8, seed=seed))
    return (GPT(GPTConfig.preset("tiny"), seed=seed, dtype=torch.float64),
            synthetic_token_batches(num_batches=steps, batch_size=rows, seq_len=16, seed=seed))


def train_data_parallel(impl, kind, seed, micro, accum, steps, bucket_cap_mb, sync_last=True, optimizer="sgd",
                        uses=None, ddp_kwargs=None, set_to_none=True, scaling=None):
    """Run on every rank: the plain training loop a DDP user writes. `scaling`: (prescale_gradients,
    gradient_predivide_factor) set on ours (DeepSpeed's keys, which the engine sets)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model, batches = _model_and_batches(kind, seed, micro * accum * world, steps, uses)
    ddp = wrap(impl, model, bucket_cap_mb, **(ddp_kwargs or {}))
    if scaling is not None:
        ddp.prescale_gradients, ddp.gradient_predivide_factor = scaling
    config = ts.EngineConfig.load({"optimizer": OPTIMIZERS[optimizer], "train_micro_batch_size_per_gpu": micro})
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], config.optimizer)
    losses = []
    with comm.record() as ledger:
        for batch in batches:
            micros = local_micro_batches(batch, dp_rank=rank, dp_size=world, micro_batch_size=micro)
            total = torch.zeros((), dtype=torch.float64)
            for i, chunk in enumerate(micros):
                last = i == len(micros) - 1
                with contextlib.nullcontext() if (last and sync_last) else ddp.no_sync():
                    loss = ddp(*chunk)
                    (loss / len(micros)).backward()
                total += loss.detach()
            dist.all_reduce(total)  # only to report the global loss; not part of the DDP under test
            losses.append(total.item() / (len(micros) * world))
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
    return losses, ts.testing.state_dict_cpu(model), ledger.calls("all_reduce"), getattr(ddp, "events", None)


def _reference(kind, seed, rows, steps, optimizer="sgd", uses=None):
    model, batches = _model_and_batches(kind, seed, rows, steps, uses)
    config = {"optimizer": OPTIMIZERS[optimizer], "train_batch_size": rows}
    return ts.reference.train(model, batches, config), model.state_dict()


@pytest.mark.parametrize("impl", DDP)
@given(world_size=st.sampled_from([2, 3, 4]), seed=st.integers(0, 2**16), micro=st.integers(1, 2),
       accum=st.integers(1, 3), bucket_cap_mb=st.sampled_from([1e-4, 2.2e-3, 25.0]),
       optimizer=st.sampled_from(sorted(OPTIMIZERS)),
       uses=st.lists(st.sets(st.integers(0, 23), max_size=2), min_size=3, max_size=3))
def test_ddp_matches_single_process_float64(impl, world_size, seed, micro, accum, bucket_cap_mb, optimizer, uses):
    # Ours: every example has a layer no rank uses and one used by drawn rows (some ranks,
    # micro-batches, steps), with no flag; torch's DDP would need find_unused_parameters.
    kind = "mlp" if impl == IMPLEMENTATIONS["torch"] else "mlp-unused"
    results = run_on_ranks(train_data_parallel, world_size, impl, kind, seed, micro, accum, 3, bucket_cap_mb,
                           True, optimizer, uses)
    ref_losses, ref_state = _reference(kind, seed, micro * accum * world_size, 3, optimizer, uses)
    for losses, state, _, _ in results:
        assert_losses_close(losses, ref_losses)
        assert_state_dicts_close(state, ref_state, what="parameters after 3 steps")


@pytest.mark.parametrize("impl", DDP)
@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_gpt_matches_single_process_float64(impl, world_size):
    results = run_on_ranks(train_data_parallel, world_size, impl, "gpt", 11, 1, 2, 2, 0.01)
    ref_losses, ref_state = _reference("gpt", 11, 2 * world_size, 2)
    for losses, state, _, _ in results:
        assert_losses_close(losses, ref_losses)
        assert_state_dicts_close(state, ref_state)


def _bucket_sizes(cap_mb):
    from tinyscale.data_parallel import assign_buckets

    model = TinyMLP()
    return [len(b) for b in assign_buckets([p for p in model.parameters() if p.requires_grad], int(cap_mb * 2**20))]


@pytest.mark.parametrize("cap_mb, expected_buckets", [(25.0, 1), (2.2e-3, 2), (1e-5, 5)])
def test_ddp_bucketed_issues_one_allreduce_per_bucket(cap_mb, expected_buckets):
    assert len(_bucket_sizes(cap_mb)) == expected_buckets
    steps = 2
    for _, _, calls, events in run_on_ranks(train_data_parallel, 2, IMPLEMENTATIONS["bucketed"], "mlp", 0, 2, 2,
                                            steps, cap_mb):
        # accumulation over 2 micro-batches still syncs once per step: no all-reduce under no_sync
        assert calls == steps * expected_buckets
        assert [e[1] for e in events if e[0] == "launch"] == list(range(expected_buckets))


def test_ddp_bucketed_first_bucket_cap_packs_the_first_to_fill_small_and_the_rest_large():
    from tinyscale.data_parallel import assign_buckets

    params = [p for p in TinyMLP().parameters() if p.requires_grad]  # bytes, last first: 128 2048 128 1024 64
    assert [len(b) for b in assign_buckets(params, 2**30)] == [5]
    # torch's layout: the first bucket (first to fill in backward) small, the rest in one. It
    # closes once it holds first_cap_bytes, as torch's: 128 + 2048 = 2176 < 2200, so the next 128
    # still goes in (2304); at a cap of 2176 it closes on reaching it
    assert [len(b) for b in assign_buckets(params, 2**30, first_cap_bytes=2200)] == [3, 2]
    assert [len(b) for b in assign_buckets(params, 2**30, first_cap_bytes=2176)] == [2, 3]
    assert [len(b) for b in assign_buckets(params, 1200)] == [1, 1, 2, 1]
    # and never beyond cap_bytes: a first cap above it changes nothing
    assert [len(b) for b in assign_buckets(params, 1200, first_cap_bytes=2200)] == [1, 1, 2, 1]


def test_ddp_bucketed_first_bucket_cap_trains_like_one_process_and_overlaps():
    # float64 tiny GPT (328,960 bytes of gradients): a 0.1 MB first bucket and one of 25 MB
    # for the rest: 2 all-reduces per step; accumulation over 2 micro-batches, weight decay
    kwargs = {"first_bucket_cap_mb": 0.1}
    results = run_on_ranks(train_data_parallel, 2, IMPLEMENTATIONS["bucketed"], "gpt", 5, 1, 2, 2, 25.0,
                           True, "adamw", None, kwargs)
    ref_losses, ref_state = _reference("gpt", 5, 4, 2, "adamw")
    for losses, state, calls, events in results:
        assert_losses_close(losses, ref_losses)
        assert_state_dicts_close(state, ref_state, what="parameters after 2 steps")
        assert calls == 2 * 2
        end = next(t for kind, _, t in events if kind == "backward_end")
        assert [b for kind, b, t in events if kind == "launch" and t < end][:1] == [0]  # the small one goes early


def test_ddp_bucketed_starts_the_first_allreduce_before_backward_finishes():
    for _, _, _, events in run_on_ranks(train_data_parallel, 2, IMPLEMENTATIONS["bucketed"], "gpt", 0, 2, 1, 1, 0.01):
        end = next(t for kind, _, t in events if kind == "backward_end")
        launched_during_backward = [b for kind, b, t in events if kind == "launch" and t < end]
        # The bucket holding the last layers fills first and is on the wire while autograd
        # is still computing the earlier layers' gradients.
        assert launched_during_backward and launched_during_backward[0] == 0
        assert len(launched_during_backward) >= 2


def _launch_times(overlap):
    ddp = BucketedDDP(GPT(GPTConfig.preset("tiny"), seed=0, dtype=torch.float64), bucket_cap_mb=0.01,
                      overlap=overlap)
    x, y = synthetic_token_batches(num_batches=1, batch_size=2, seq_len=16, seed=dist.get_rank())[0]
    ddp(x, y).backward()
    end = next(t for kind, _, t in ddp.events if kind == "backward_end")
    return [t < end for kind, _, t in ddp.events if kind == "launch"]


def test_ddp_bucketed_without_overlap_launches_only_after_backward():
    for before_end in run_on_ranks(_launch_times, 2, False):
        assert len(before_end) > 1 and not any(before_end)


def test_ddp_naive_issues_one_allreduce_per_trainable_parameter():
    n = len([p for p in TinyMLP().parameters() if p.requires_grad])
    for _, _, calls, _ in run_on_ranks(train_data_parallel, 3, IMPLEMENTATIONS["naive"], "mlp", 0, 1, 2, 2, None):
        assert calls == 2 * (n + 1)  # per step: one per parameter, one for the usage flags


@pytest.mark.parametrize("impl", DDP)
def test_ddp_no_sync_on_the_last_micro_step_is_the_classic_bug(impl):
    # Forgetting to leave no_sync for the last micro-batch means no gradient is ever
    # averaged: each rank steps on its own shard and the replicas drift apart.
    results = run_on_ranks(train_data_parallel, 2, impl, "mlp", 0, 2, 2, 2, 25.0, False)
    assert any(not torch.equal(results[0][1][k], results[1][1][k]) for k in results[0][1])
    assert all(r[2] == 0 for r in results)  # and not a byte was all-reduced


class SometimesSkipsShared(torch.nn.Module):
    """TinyMLP whose forward can leave the `shared` layer (a parameter used twice) unused."""

    def __init__(self):
        super().__init__()
        self.mlp = TinyMLP(seed=0)

    def forward(self, x, y, skip_shared: bool):
        if not skip_shared:
            return self.mlp(x, y)
        h = torch.relu(self.mlp.fc_in(x))
        out = torch.nn.functional.linear(h, self.mlp.fc_in.weight.t(), self.mlp.out_bias)
        return torch.nn.functional.mse_loss(out, y)


def _unused_parameter(impl, find_unused, unused_on):
    rank = dist.get_rank()
    model = SometimesSkipsShared()
    ddp = wrap(impl, model, 1e-4, find_unused_parameters=find_unused)
    x, y = synthetic_regression_batches(num_batches=1, batch_size=4, dim=8, seed=rank)[0]
    ddp(x, y, rank in unused_on).backward()
    return {n.removeprefix("mlp."): None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("impl", DDP)
def test_ddp_find_unused_parameters(impl):
    # Unused on every rank: no gradient at all, as in one process.
    for grads in run_on_ranks(_unused_parameter, 2, impl, True, (0, 1)):
        assert grads["shared.weight"] is None and grads["fc_in.weight"] is not None
    # Unused on rank 1 only: every rank ends with the same averaged gradient.
    results = run_on_ranks(_unused_parameter, 2, impl, True, (1,))
    assert torch.equal(results[0]["shared.weight"], results[1]["shared.weight"])


@pytest.mark.parametrize("impl", OURS)
def test_ddp_unused_parameters_need_no_flag(impl):
    # Ours always find unused parameters (flags ride in the last bucket, or one small all-reduce).
    for grads in run_on_ranks(_unused_parameter, 2, impl, False, (0, 1)):
        assert grads["shared.weight"] is None and grads["fc_in.weight"] is not None
    results = run_on_ranks(_unused_parameter, 2, impl, False, (1,))
    assert results[0]["shared.weight"] is not None
    assert torch.equal(results[0]["shared.weight"], results[1]["shared.weight"])


def _no_sync_restores(impl):
    ddp = wrap(impl, TinyMLP(seed=0), None)
    with contextlib.suppress(ZeroDivisionError), ddp.no_sync():
        raise ZeroDivisionError
    x, y = synthetic_regression_batches(num_batches=1, batch_size=2, dim=8, seed=dist.get_rank())[0]
    with comm.record() as ledger:
        ddp(x, y).backward()
    return ledger.calls("all_reduce") > 0


@pytest.mark.parametrize("impl", OURS)
def test_ddp_no_sync_restores_synchronisation_after_an_exception(impl):
    assert all(run_on_ranks(_no_sync_restores, 2, impl))


def _backward_raises_then_recovers(impl):
    model = TinyMLP(seed=0)
    ddp = wrap(impl, model, 1e-4)
    x, y = synthetic_regression_batches(num_batches=1, batch_size=4, dim=8, seed=dist.get_rank())[0]
    out = ddp(x, y)
    # A failure in the middle of backward (as an out-of-memory error would be), on every rank:
    # the last layers' gradients are already in and their bucket may be on the wire.
    model.fc_in.weight.register_hook(lambda g: (_ for _ in ()).throw(MemoryError("simulated")))
    with contextlib.suppress(MemoryError):
        out.backward()
    model.fc_in.weight._backward_hooks.clear()
    model.zero_grad(set_to_none=True)
    with comm.record() as ledger:
        ddp(x, y).backward()
    return ledger.calls("all_reduce"), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("impl", OURS)
def test_ddp_recovers_after_a_backward_that_raised(impl):
    (calls0, grads0), (calls1, grads1) = run_on_ranks(_backward_raises_then_recovers, 2, impl)
    assert calls0 > 0 and calls1 > 0  # the next backward synchronises again
    assert all(torch.equal(grads0[k], grads1[k]) for k in grads0)



def _bucket_view_training(as_view, set_to_none):
    """GPT steps with accumulation 2 and weight decay, zeroing .grad in place or to None: the
    losses, the parameters, and whether every .grad lives in its bucket after each step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model, batches = _model_and_batches("gpt", 5, 2 * 2 * world, 3)
    ddp = BucketedDDP(model, bucket_cap_mb=2.2e-3, gradient_as_bucket_view=as_view)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    storages = {b.buffer.untyped_storage().data_ptr() for b in ddp.buckets}
    losses, in_bucket = [], []
    for batch in batches:
        micros = local_micro_batches(batch, dp_rank=rank, dp_size=world, micro_batch_size=2)
        total = torch.zeros((), dtype=torch.float64)
        for i, chunk in enumerate(micros):
            with contextlib.nullcontext() if i == len(micros) - 1 else ddp.no_sync():
                loss = ddp(*chunk)
                (loss / len(micros)).backward()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(total.item() / (len(micros) * world))
        in_bucket.append(all(p.grad.untyped_storage().data_ptr() in storages for p in ddp.params))
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    return losses, ts.testing.state_dict_cpu(model), in_bucket


@pytest.mark.parametrize(("as_view", "set_to_none"), [(True, False), (True, True), (False, False)])
def test_ddp_bucketed_gradient_as_bucket_view_trains_like_one_process(as_view, set_to_none):
    """gradient_as_bucket_view (default on): each .grad is its bucket slot, also when zeroed in
    place and accumulated into by the next backwards (the copy in skipped); off: its own copy.
    Float64 losses and parameters equal one process's on the whole batch either way."""
    assert inspect.signature(BucketedDDP).parameters["gradient_as_bucket_view"].default is True
    results = run_on_ranks(_bucket_view_training, 2, as_view, set_to_none)
    model, batches = _model_and_batches("gpt", 5, 8, 3)
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}, "train_batch_size": 8}
    ref_losses = ts.reference.train(model, batches, config)
    for losses, state, in_bucket in results:
        assert_losses_close(losses, ref_losses)
        assert_state_dicts_close(state, model.state_dict())
        assert in_bucket == [as_view] * 3


# 3 ranks x 2 micro-batches of 1 row: rank r's micro-batch k is row 2r + k. `extra` is used by
# rank 0's first micro-batch (step 0: its gradient arrives under no_sync, so the last backward's
# hook never fires for it and the end of backward puts it in the bucket); again there and by
# rank 1's last (step 1: zeroed in place, rank 0's .grad is already its bucket slot); then by no
# row (None everywhere, as in one process) or, when zeroed in place, by rank 2's last (a zeroed
# .grad is a gradient: one process would step it too); by rank 1's first micro-batch (step 3).
def _divide_uses(set_to_none):
    return [{0}, {0, 3}, set() if set_to_none else {5}, {2}]


@pytest.mark.parametrize(("set_to_none", "scaling"), [(False, (True, 1.0)), (False, (False, 2.0)),
                                                        (True, (False, 1.0))])
def test_ddp_bucketed_divides_each_gradient_once_on_its_way_into_the_bucket(set_to_none, scaling):
    """The division by N (prescaled), or by the predivide factor and the rest after the sum, is
    made once per gradient as it enters its bucket (after the copy in, or in place where autograd
    accumulated into the bucket itself), also for gradients filled in at the end of backward (used
    in an earlier micro-batch only). Float64, 3 ranks (a third is inexact), SGD: one process's steps."""
    uses = _divide_uses(set_to_none)
    results = run_on_ranks(train_data_parallel, 3, IMPLEMENTATIONS["bucketed"], "mlp-unused", 3, 1, 2, 4, 2.2e-3,
                           True, "sgd", uses, None, set_to_none, scaling)
    ref_losses, ref_state = _reference("mlp-unused", 3, 6, 4, "sgd", uses)
    for losses, state, calls, _ in results:
        assert_losses_close(losses, ref_losses)
        assert_state_dicts_close(state, ref_state, what="parameters after 4 steps")
        assert calls == 4 * len(_bucket_sizes_of(UnusedMLP(), 2.2e-3))  # one all-reduce per bucket, no more


def _bucket_sizes_of(model, cap_mb):
    from tinyscale.data_parallel import assign_buckets

    return [len(b) for b in assign_buckets([p for p in model.parameters() if p.requires_grad], int(cap_mb * 2**20))]


def test_ddp_bucketed_buckets_that_fill_out_of_order_launch_in_order_during_backward():
    """A bucket that fills before the one ahead of it waits for it; when that one fills, the hook
    launches it and every full bucket behind it, in index order, all before backward ends. Float64,
    3 ranks, one parameter per bucket (7), accumulation over 2 micro-batches: one process's steps."""
    results = run_on_ranks(train_data_parallel, 3, IMPLEMENTATIONS["bucketed"], "mlp-head-first", 4, 1, 2, 2,
                           1e-5)
    ref_losses, ref_state = _reference("mlp-head-first", 4, 6, 2)
    for losses, state, calls, events in results:
        assert_losses_close(losses, ref_losses)
        assert_state_dicts_close(state, ref_state, what="parameters after 2 steps")
        assert calls == 2 * 7
        end = next(t for kind, _, t in events if kind == "backward_end")
        assert [(b, t < end) for kind, b, t in events if kind == "launch"] == [(b, True) for b in range(7)]


def _create_graph_grads():
    """One backward with create_graph=True on this rank's half of the batch: the averaged .grad."""
    model, ((x, y),) = _model_and_batches("mlp", 2, 4, 1)
    ddp = BucketedDDP(model, bucket_cap_mb=2.2e-3)
    rows = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    ddp(x[rows], y[rows]).backward(create_graph=True)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_ddp_bucketed_backward_with_create_graph_averages_like_one_process():
    """backward(create_graph=True) runs the hooks with grad mode on: the copy into the bucket must
    stay out of the graph (an out= op refuses inputs that require grad). Float64, 2 ranks."""
    model, ((x, y),) = _model_and_batches("mlp", 2, 4, 1)
    model(x, y).backward()
    for grads in run_on_ranks(_create_graph_grads, 2):
        for name, grad in grads.items():
            # float64: the same sums in another order (two halves' means, averaged): rtol 1e-10
            torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, rtol=1e-10, atol=0)
