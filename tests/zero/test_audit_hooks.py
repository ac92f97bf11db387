"""Audit of ZeroStage1/2's gradient hooks on models users bring (2 ranks, float64, rtol 1e-10 against
one process with torch's optimizer): a weight used twice in one backward, one used only in one
rank's no_sync micro-batch, one frozen between steps (requires_grad flipped), and a .grad the user
sets outside backward (no hook runs for it). Run: `pytest tests/zero -k audit_hooks`."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tinyscale.testing import assert_state_dicts_close, run_on_ranks

WORLD, MICRO, ROWS, STEPS = 2, 2, 8, 3


class Model(nn.Module):
    """`a` used twice on one path, `c` only where the step's plan says, `side` in no forward."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        new = lambda *s: nn.Parameter(0.4 * torch.randn(*s, generator=g, dtype=torch.float64))  # noqa: E731
        self.a, self.b, self.c, self.side = new(6, 6), new(6, 6), new(6, 6), new(6)

    def forward(self, x: torch.Tensor, use_c: bool) -> torch.Tensor:
        h = torch.tanh(torch.tanh(torch.tanh(x @ self.a) @ self.b) @ self.a)
        if use_c:
            h = h + h @ self.c
        return h.square().mean()


def _batch(step: int) -> torch.Tensor:
    return torch.randn(ROWS, 6, generator=torch.Generator().manual_seed(100 + step), dtype=torch.float64)


def _rows(x, rank, micro):
    per = ROWS // WORLD // MICRO
    return x[(rank * MICRO + micro) * per: (rank * MICRO + micro + 1) * per]


def _make(groups):
    return torch.optim.AdamW(groups, lr=0.05, weight_decay=0.05)


def _train(stage: int | None, scenario: str) -> dict:
    """stage None: one process over every rank's rows; else this rank's under ZeroStage{stage}."""
    from tinyscale.zero import ZeroStage1, ZeroStage2
    model = Model()
    ranks = range(WORLD) if stage is None else [dist.get_rank()]
    stage_cls = ZeroStage1 if stage == 1 else ZeroStage2
    # bucket_bytes 8 x 80: the units are [side, c, b] and [a]
    opt = _make(model.parameters()) if stage is None else stage_cls(model.parameters(), _make, bucket_bytes=8 * 80)
    for step in range(STEPS):
        if scenario == "frozen" and step == 1:
            model.b.requires_grad_(False)
        x = _batch(step)
        for rank in ranks:
            for micro in range(MICRO):
                if scenario == "user_grad" and micro == MICRO - 1:
                    model.side.grad = torch.full((6,), 0.1 * (step + 1), dtype=torch.float64)  # same on every rank
                use_c = scenario != "c_once" or (rank == 1 and micro == 0)  # c: rank 1's no_sync backward only
                last = micro == MICRO - 1
                with opt.no_sync() if stage is not None and not last else contextlib.nullcontext():
                    (model(_rows(x, rank, micro), use_c) / (MICRO * len(ranks))).backward()
        opt.step()
        if stage is None:
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("scenario", ["frozen", "c_once"])
def test_zero_audit_hooks_shared_frozen_and_rarely_used_weights_train_like_one_process(stage, scenario):
    expected = _train(None, scenario)
    for rank, state in enumerate(run_on_ranks(_train, WORLD, stage, scenario)):
        assert_state_dicts_close(state, expected, what=f"ZeroStage{stage} {scenario} rank {rank}")


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_audit_hooks_a_grad_set_outside_backward_is_stepped_like_one_process(stage):
    """torch's optimizer steps a parameter whose .grad the user set; ZeRO must too (it reduces that
    .grad already, then dropped it as unused: `side` stayed at its initial value)."""
    expected = _train(None, "user_grad")
    for rank, state in enumerate(run_on_ranks(_train, WORLD, stage, "user_grad")):
        assert_state_dicts_close(state, expected, what=f"ZeroStage{stage} user-set .grad rank {rank}")
