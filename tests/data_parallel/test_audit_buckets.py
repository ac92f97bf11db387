"""Audit of BucketedDDP's buckets on models users bring (3 ranks, float64, rtol 1e-10 against one
process with torch's optimizer): parameter sizes that straddle the first bucket's cap, one parameter
larger than the cap, a parameter one rank never uses and one used only in one rank's no_sync
micro-batch, a .grad the user adds outside backward, gradient_as_bucket_view on and off with
zero_grad(set_to_none) either way. Run: `pytest tests/data_parallel -k audit_buckets`."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tinyscale.testing import assert_state_dicts_close, run_on_ranks

WORLD, MICRO, ROWS, STEPS = 3, 2, 12, 3
SIZES = [40, 30, 500, 60, 70, 1, 9]  # float64 elements; registered in this order, bucketed last first
HUGE, RARE, SET = 2, 4, 6  # 500 elements: 4,000 B, over the 1,000 B cap; used rarely; .grad added to


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ps = nn.ParameterList(nn.Parameter(0.3 * torch.randn(n, generator=g, dtype=torch.float64))
                                   for n in SIZES)

    def forward(self, x: torch.Tensor, skip: int | None) -> torch.Tensor:
        h = x
        for i, p in enumerate(self.ps):
            if i != skip:
                h = torch.tanh(h * p[:1] + 0.01 * p.sum() + (p * p).mean())
        return h.square().mean()


def _skip(step: int, rank: int, micro: int) -> int | None:
    """Step 1: RARE used nowhere. Else rank 0 never uses HUGE; RARE only in rank 1's first micro-batch."""
    if step == 1:
        return RARE
    return {0: HUGE, 1: RARE if micro else None}.get(rank, RARE)


def _make(name: str):
    if name == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)
    return lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.05)


def _add_user_grad(model: Model) -> None:
    g = torch.full((SIZES[SET],), 0.2, dtype=torch.float64)  # the same on every rank: its mean is itself
    p = model.ps[SET]
    p.grad = g if p.grad is None else p.grad + g


def _train(ddp_kwargs: dict | None, optimizer: str, set_to_none: bool):
    """ddp_kwargs None: one process over every rank's rows; else this rank's rows under BucketedDDP."""
    from tinyscale.data_parallel import BucketedDDP
    model = Model()
    ddp = None if ddp_kwargs is None else BucketedDDP(model, **ddp_kwargs)
    opt = _make(optimizer)(model.parameters())
    ranks = range(WORLD) if ddp is None else [dist.get_rank()]
    per = ROWS // WORLD // MICRO
    for step in range(STEPS):
        x = torch.randn(ROWS, 4, generator=torch.Generator().manual_seed(7 + step), dtype=torch.float64)
        for rank in ranks:
            for micro in range(MICRO):
                if ddp is not None and micro == MICRO - 1:
                    _add_user_grad(model)
                rows = x[(rank * MICRO + micro) * per: (rank * MICRO + micro + 1) * per]
                with ddp.no_sync() if ddp is not None and micro < MICRO - 1 else contextlib.nullcontext():
                    ((ddp or model)(rows, _skip(step, rank, micro)) / (MICRO * len(ranks))).backward()
        if ddp is None:
            _add_user_grad(model)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    layout = None if ddp is None else [[SIZES.index(p.numel()) for p in b.params] for b in ddp.buckets]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, layout


CAP = 1000 / 2**20  # MiB: 1,000 B, 125 float64
CASES = {  # the first bucket closes once it holds 600 B: 9 + 1 + 70 elements (640 B) cross it
    "view-keep-first600": (dict(bucket_cap_mb=CAP, first_bucket_cap_mb=600 / 2**20), "adamw", False,
                           [[6, 5, 4], [3], [2], [1, 0]]),
    "copy-none-nofirst": (dict(bucket_cap_mb=CAP, gradient_as_bucket_view=False), "sgd", True,
                          [[6, 5, 4], [3], [2], [1, 0]]),
    "view-none-firsttiny": (dict(bucket_cap_mb=5000 / 2**20, first_bucket_cap_mb=1 / 2**20), "adamw", True,
                            [[6], [5, 4, 3], [2, 1, 0]]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ddp_audit_buckets_straddling_huge_unused_and_user_grads_train_like_one_process(case):
    kwargs, optimizer, set_to_none, layout = CASES[case]
    expected, _ = _train(None, optimizer, set_to_none)
    for rank, (state, got) in enumerate(run_on_ranks(_train, WORLD, kwargs, optimizer, set_to_none)):
        assert got == layout, f"rank {rank} buckets {got}"
        assert_state_dicts_close(state, expected, what=f"BucketedDDP {case} rank {rank}")
