"""`ZeroOptimizer` under a learning-rate scheduler (`pytest -k zero_optimizer_api`): a
scheduler changes the wrapper's `param_groups`; each step must carry the change to the optimizer
that steps this rank's shard, or every rank would go on at the first lr. StepLR halving the lr
every step, against plain SGD with the same StepLR in one process on the mean gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tinyscale.testing import run_on_ranks
from tinyscale.zero import ZeroOptimizer

SHAPES, STEPS = [(4, 3), (3,), (5,)], 4


def _grads(step: int, rank: int) -> list[torch.Tensor]:
    return [torch.randn(s, generator=torch.Generator().manual_seed(100 * step + 10 * rank + i), dtype=torch.float64)
            for i, s in enumerate(SHAPES)]


def _train(sharded: bool, stage: int = 1):
    params = [nn.Parameter(torch.linspace(-1, 1, torch.Size(s).numel(), dtype=torch.float64).view(s)) for s in SHAPES]
    world = dist.get_world_size() if sharded else 2
    if sharded:
        opt = ZeroOptimizer(params, torch.optim.SGD, reduce_grads=True, stage=stage, lr=0.4, momentum=0.9)
    else:
        opt = torch.optim.SGD(params, lr=0.4, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    trace = []
    for step in range(STEPS):
        for i, p in enumerate(params):
            if sharded:  # this rank's gradient (stage 2 reduces in the hooks: backward of p . g)
                g = _grads(step, dist.get_rank())[i]
                (p * g).sum().backward() if stage == 2 else setattr(p, "grad", g)
            else:
                p.grad = sum(_grads(step, r)[i] for r in range(world)) / world
        opt.step()
        opt.zero_grad()
        schedule.step()
        trace.append([p.detach().clone() for p in params])
    return trace


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_optimizer_api_step_lr_reaches_the_shards_optimizer(stage):
    expected = _train(False)
    for trace in run_on_ranks(_train, 2, True, stage):
        for step, (ours, theirs) in enumerate(zip(trace, expected)):
            for a, b in zip(ours, theirs):
                # 1e-12: float64, the mean gradient summed in another order (reduce of g / N vs sum / N)
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"step {step}")
