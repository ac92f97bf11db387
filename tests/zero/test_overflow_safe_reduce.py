"""Averaging gradients cannot overflow where the average itself would not (`pytest -k
overflow_safe_reduce`): every wrapper divides by the world size before summing, as torch's DDP
does. On 4 ranks an fp16 gradient of 40000 on each (fp16's max is 65504) sums to 160000, which
is inf in fp16; divided first, 10000 x 4 = 40000, exact. The same holds for the ZeRO stages'
reduce-scatter (stage 3 uses the same `ShardedOptimizer.reduce_scatter_into`).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tinyscale.data_parallel import BucketedDDP, NaiveDDP
from tinyscale.zero import ZeroStage1, ZeroStage2

BIG = 40000.0  # < 65504 (fp16 max); 4 x BIG is not


class Scaled(nn.Module):
    """loss = sum(w * x): the gradient of w is x, exactly, in fp16."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(6, dtype=torch.float16))

    def forward(self, x):
        return (self.w * x).sum()


def _reduce(kind):
    model = Scaled()
    x = torch.full((6,), BIG, dtype=torch.float16)
    make = lambda groups: torch.optim.SGD(groups, lr=0.0)  # noqa: E731
    if kind in ("naive", "bucketed"):
        wrapped = NaiveDDP(model) if kind == "naive" else BucketedDDP(model)
        wrapped(x).backward()
        return model.w.grad.clone()
    zero = ZeroStage1(model.parameters(), make) if kind == "zero1" else ZeroStage2(model.parameters(), make)
    model(x).backward()  # both stages reduce-scatter in the (last) backward
    shard = zero.sharded.grad[0].clone()  # this rank's 6/4 -> 2 elements
    zero.step()
    return shard


@pytest.mark.parametrize("kind", ["naive", "bucketed", "zero1", "zero2"])
def test_overflow_safe_reduce_fp16_near_max_on_4_ranks(kind):
    from tinyscale.testing import run_on_ranks

    for rank, grad in enumerate(run_on_ranks(_reduce, 4, kind)):
        assert grad.dtype == torch.float16 and torch.isfinite(grad).all(), (rank, grad)
        # exact: BIG / 4 is exact in fp16, and so is 4 x (BIG / 4); padding (zero2's last shard) stays 0
        expected = torch.full_like(grad, BIG)
        if kind.startswith("zero") and rank == 3:
            expected[:] = 0.0  # 6 elements padded to 8: rank 3's shard is all padding
        assert torch.equal(grad, expected), (rank, grad)
