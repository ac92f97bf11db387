"""A gradient penalty (double backward) trained under ZeroStage1 and ZeroStage2 with
`backward(create_graph=True)`, as one process trains it (`pytest -k create_graph`).

The loss of each row is TinyMLP's squared error plus LAMBDA times the squared norm of that
error's gradient with respect to the row's input (WGAN-GP's penalty, made per row so that
splitting the batch over ranks does not change it). Its parameter gradient goes through second
derivatives, and the backward is called with create_graph=True (as second-order optimizers
such as AdaHessian call it): autograd then runs the gradient hooks with grad mode on, and
gradients that carry a graph. The hooks (zero/stage1.py and stage2.py, `_on_grad`) must copy
them into their buckets outside the graph: with the copies in the graph the numbers come out
the same, but every bucket sent, and stage 1's accumulated buffers, would keep the backward's
graph alive; the test checks that none does. Float64, 2 and 3 ranks, 2 accumulated micro-batches
(stage 1 accumulates under `no_sync`), clipping, weight decay, TinyMLP's frozen layer and tied
weight, buckets smaller than the model (several units, padding on 3 ranks): equal to one
process at rtol 1e-10 (tinyscale.testing).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from tinyscale.models import TinyMLP
from tinyscale.testing import assert_state_dicts_close, run_on_ranks, state_dict_cpu

MICRO, ACCUM, STEPS = 2, 2, 3
LAMBDA, CLIP, LR, DECAY = 0.5, 0.05, 1e-2, 0.05


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    rows = world * ACCUM * MICRO
    return [(torch.randn(rows, 8, generator=gen, dtype=torch.float64),
             torch.randn(rows, 8, generator=gen, dtype=torch.float64)) for _ in range(STEPS)]


def penalized_loss(model: TinyMLP, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean over the rows of (squared error + LAMBDA * |d error / d row|^2)."""
    x = x.detach().requires_grad_(True)
    loss = model(x, y)  # the mean over rows of each row's error
    (gx,) = torch.autograd.grad(loss * x.shape[0], x, create_graph=True)  # row r's: its own error's
    return loss + LAMBDA * gx.pow(2).sum(dim=1).mean()


def _train(stage: int) -> dict:
    from tinyscale.zero import ZeroStage1, ZeroStage2

    world, rank = dist.get_world_size(), dist.get_rank()
    model = TinyMLP(seed=0)
    make = lambda groups: torch.optim.AdamW(groups, lr=LR, weight_decay=DECAY)  # noqa: E731
    zero = (ZeroStage1 if stage == 1 else ZeroStage2)(model.parameters(), make, bucket_bytes=8 * 150,
                                                      first_bucket_bytes=8 * 40)
    assert len(zero.sharded.units) > 2
    sent, held = [], []  # per reduce-scatter and per backward: did a tensor carry the graph?
    reduce_scatter_into = zero.sharded.reduce_scatter_into

    def recording(u, grads, async_op=False, *, flat=None):
        sent.append(any(t is not None and t.requires_grad for t in [flat, *(grads or [])]))
        return reduce_scatter_into(u, grads, async_op, flat=flat)
    zero.sharded.reduce_scatter_into = recording
    for x, y in _batches(world):
        for micro in range(ACCUM):
            rows = slice((rank * ACCUM + micro) * MICRO, (rank * ACCUM + micro + 1) * MICRO)
            last = micro == ACCUM - 1
            with zero.no_sync() if stage == 1 and not last else contextlib.nullcontext():
                (penalized_loss(model, x[rows], y[rows]) / ACCUM).backward(create_graph=True)
            kept = [p.grad for p in model.parameters()] + list(zero.sharded.grad) + \
                (list(zero.grad_flat) if stage == 1 else [])
            held.append(any(t is not None and t.requires_grad for t in kept))
        zero.step(max_norm=CLIP)
    return state_dict_cpu(model), sent, held


def _one_process(world: int) -> dict:
    model = TinyMLP(seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=DECAY)
    for x, y in _batches(world):  # the whole batch in one backward (no create_graph: the plain truth)
        penalized_loss(model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return state_dict_cpu(model)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [1, 2], ids=["zero1", "zero2"])
def test_zero_create_graph_gradient_penalty_trains_like_one_process_float64(stage, world):
    expected = _one_process(world)
    for state, sent, held in run_on_ranks(_train, world, stage):
        assert_state_dicts_close(state, expected, what=f"zero{stage}, {world} ranks, create_graph=True")
        # the hooks copy outside the graph: no reduce-scatter sends, and no buffer keeps, a
        # tensor that requires grad (the backward's whole graph would live as long as it)
        assert sent and not any(sent), "a bucket sent by a create_graph backward carries the graph"
        assert not any(held), "a gradient buffer kept after a create_graph backward carries the graph"
