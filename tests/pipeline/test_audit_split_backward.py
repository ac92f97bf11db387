"""Audit of zero-bubble's B/W split (`tinyscale.pipeline.split_backward`) on models users bring,
float64 on one process: a parameter whose gradient autograd hands over in another layout than the
parameter's (a `p.sum()`'s arrives expanded, stride 0, one element for all) must land in .grad laid
out as the parameter, as torch's AccumulateGrad does; else the next micro-batch's in-place add
(or clipping's in-place scale) raises. Both of W's paths: a later stage's (`backward_weight`) and
the first stage's (the executor's W, through AccumulateGrad). Hooks under the split: `-k zb_hooks`.
Run: `pytest tests/pipeline -k audit_split_backward`."""

from __future__ import annotations

import torch
from torch import nn

from tinyscale.pipeline.executor import PipelineExecutor
from tinyscale.pipeline.schedules import add_communication, zb_h1
from tinyscale.pipeline.split_backward import backward_input, backward_weight
from tinyscale.testing import assert_state_dicts_close


class Summed(nn.Module):
    """A gate read through its sum (its gradient arrives expanded) beside ordinary weights."""

    def __init__(self, c: int = 5) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        new = lambda *s: nn.Parameter(torch.randn(*s, generator=g, dtype=torch.float64) / c ** 0.5)  # noqa: E731
        self.w, self.gate, self.v = new(c, c), new(c), new(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh((x @ self.w) * self.gate.sum()) @ self.v


def _inputs(m: int = 3, c: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randn(4, c, generator=g, dtype=torch.float64) for _ in range(m)]


def _plain(inputs) -> dict:
    module = Summed()
    for x in inputs:
        module(x).square().sum().backward()
    return {k: p.grad for k, p in module.named_parameters()}


def _check(module: nn.Module, expected: dict, what: str) -> None:
    for k, p in module.named_parameters():
        assert p.grad.stride() == p.stride(), f"{what}: {k}.grad strides {p.grad.stride()}, {k}'s {p.stride()}"
    torch.nn.utils.clip_grad_norm_(list(module.parameters()), 1e9)  # scales .grad in place (by ~1 here)
    # float64 (eps 2.2e-16): the same products, only the order of a few sums differs
    assert_state_dicts_close({k: p.grad for k, p in module.named_parameters()}, expected, rtol=1e-10, what=what)


def test_pp_audit_split_backward_an_expanded_gradient_accumulates_over_micro_batches_float64():
    """A later stage: B, B, B then W, W, W (zb_h1's order on its last stage) equals plain backward."""
    inputs, module = _inputs(), Summed()
    kept = []
    for x in inputs:
        x = x.clone().requires_grad_()
        out = module(x)
        loss = out.square().sum()
        _, k = backward_input(loss, None, x, list(module.parameters()))
        kept.append(k)
    for k in kept:
        backward_weight(k)
    _check(module, _plain(inputs), "split backward, later stage")


def test_pp_audit_split_backward_first_stage_w_accumulates_an_expanded_gradient_float64():
    """The first stage's W (the executor's, p = 1: stage 0 is also the last) over 3 micro-batches."""
    inputs, module = _inputs(), Summed()
    executor = PipelineExecutor(add_communication(zb_h1(1, 3)), 0, {0: module},
                                loss_fn=lambda out, _: out.square().sum())
    executor.run(inputs, [None] * 3)
    expected = {k: g / 3 for k, g in _plain(inputs).items()}  # the executor's backward seed is 1 / m
    _check(module, expected, "zb_h1 first stage")
