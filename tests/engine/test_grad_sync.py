"""Gradient synchronisation, through the seam: any implementation must turn per-rank gradients
into the gradient of the global-batch mean. The engine's own version is one entry; a learner's
file is another (TINYSCALE_IMPL_GRAD_SYNC=file.py:average_gradients).

Interface: ``average_gradients(params, group, dp_size)`` replaces each ``p.grad`` (possibly
None: a parameter unused on this rank) with the mean over the group's ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from tinyscale.data import shard_rows, synthetic_regression_batches
from tinyscale.models import TinyMLP
from tinyscale.testing import implementations, resolve, run_on_ranks

GRAD_SYNC = implementations("grad_sync", {"engine": "tinyscale.engine.data_parallel:average_gradients"})


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _sync_on_ranks(impl, seed, rows_per_rank, skip_shared_on_rank):
    average_gradients = resolve(impl)
    world = dist.get_world_size()
    model = TinyMLP(seed=seed)
    (batch,) = synthetic_regression_batches(num_batches=1, batch_size=rows_per_rank * world, dim=8, seed=seed)
    x, y = shard_rows(batch, dist.get_rank(), world)
    if dist.get_rank() == skip_shared_on_rank:
        # This rank's forward leaves `shared` unused: its grad stays None here but not elsewhere.
        loss = torch.nn.functional.mse_loss(torch.nn.functional.linear(
            torch.relu(model.fc_in(x)), model.fc_in.weight.t(), model.out_bias), y)
    else:
        loss = model(x, y)
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    average_gradients(params, None, world)
    return _grads(model)


@pytest.mark.parametrize("impl", GRAD_SYNC)
@given(world_size=st.sampled_from([2, 3, 4]), seed=st.integers(0, 1000), rows=st.integers(1, 3))
def test_grad_sync_gives_the_global_mean_gradient(impl, world_size, seed, rows):
    results = run_on_ranks(_sync_on_ranks, world_size, impl, seed, rows, -1)
    model = TinyMLP(seed=seed)
    (batch,) = synthetic_regression_batches(num_batches=1, batch_size=rows * world_size, dim=8, seed=seed)
    model(*batch).backward()
    expected = _grads(model)
    for grads in results:
        assert grads.keys() == expected.keys()
        for name, g in expected.items():
            # float64; the mean of per-rank means equals the global mean up to ~1e-16 relative.
            torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("impl", GRAD_SYNC)
def test_grad_sync_survives_a_parameter_unused_on_one_rank(impl):
    results = run_on_ranks(_sync_on_ranks, 3, impl, 0, 2, 1)
    # Every rank must end with the same gradient for `shared`, including the rank that did
    # not use it (whose contribution is zero), and nothing may hang.
    for grads in results[1:]:
        assert torch.equal(grads["shared.weight"], results[0]["shared.weight"])
