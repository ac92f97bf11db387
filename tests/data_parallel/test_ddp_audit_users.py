"""An independent check of BucketedDDP's packing (`_pack`: one cat and one div_ a full bucket)
with a model as users bring them (`pytest -k ddp_audit_users`).

A layer used twice, a layer no forward uses, a layer used for some rows only (on some ranks,
per step), a float32 layer among float64 ones (a bucket of its own dtype), small buckets;
no_sync accumulation of two micro-batches, and `.grad` kept between steps (set_to_none False:
autograd accumulates into the bucket) or dropped. 2 and 3 ranks: each step's averaged gradients
equal one process's on the whole batch (float64: rtol 1e-10, only the summation order differs;
the float32 layer: rtol 1e-6, float32's rounding of the same sums in another order).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tinyscale.data_parallel import BucketedDDP
from tinyscale.testing import run_on_ranks

ROWS, STEPS = 12, 4
# rows that use `gated`, per step: none, the last rank's second micro-batch, none, two ranks
GATED = [(), (11,), (), (0, 5)]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 6).double()
        self.shared = nn.Linear(6, 6).double()
        self.unused = nn.Linear(6, 6).double()
        self.single = nn.Linear(6, 6)  # float32
        self.gated = nn.Linear(6, 6).double()  # in one bucket with `out`
        self.out = nn.Linear(6, 3).double()

    def forward(self, x, y):
        h = torch.tanh(self.shared(torch.tanh(self.shared(torch.tanh(self.a(x))))))  # shared: twice
        rows = (x[:, 0] > 5).nonzero().flatten()
        if len(rows):
            h = h.index_add(0, rows, torch.tanh(self.gated(h[rows])))
        # the float32 layer on a branch of its own: the float64 layers' gradients stay float64 sums
        side = torch.mean(torch.tanh(self.single(x.float().repeat(1, 2)[:, :6])) ** 2).double()
        return torch.mean((self.out(h) - y) ** 2) + side


def batch(step: int):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(ROWS, 4, generator=gen, dtype=torch.float64).clamp(-3, 3)
    x[list(GATED[step]), 0] = 10.0
    return x, torch.randn(ROWS, 3, generator=gen, dtype=torch.float64)


def _ddp(set_to_none: bool, as_view: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Net()
    ddp = BucketedDDP(model, bucket_cap_mb=600 / 2**20, find_unused_parameters=True, gradient_as_bucket_view=as_view)
    # gated's bucket also holds `out`: at step 1 (set_to_none False) out's .grad is its slot, gated's
    # (None after step 0, unused everywhere) a tensor of its own, and on the last rank it is used
    # in the synchronising micro-batch: a full bucket of mixed gradients
    assert [[n for n, q in model.named_parameters() if any(q is p for p in b.params)] for b in ddp.buckets][0] == \
        ["gated.weight", "gated.bias", "out.weight", "out.bias"]
    per, half = ROWS // world, ROWS // world // 2
    out = []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        with ddp.no_sync():
            (ddp(x[:half], y[:half]) / 2).backward()
        (ddp(x[half:], y[half:]) / 2).backward()
        out.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():  # a step, so the next one's gradients differ
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(0.1 * p.grad)
        model.zero_grad(set_to_none=set_to_none)
    return out


def _reference():
    model = Net()
    out = []
    for step in range(STEPS):
        x, y = batch(step)
        model.zero_grad(set_to_none=True)
        for rows in (slice(0, ROWS // 2), slice(ROWS // 2, ROWS)):  # (a mean over equal halves)
            (model(x[rows], y[rows]) / 2).backward()
        out.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(0.1 * p.grad)
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("set_to_none", "as_view"), [(True, True), (False, True), (True, False)])
def test_ddp_audit_users_buckets_average_like_one_process(world, set_to_none, as_view):
    ref = _reference()
    for grads in run_on_ranks(_ddp, world, set_to_none, as_view):
        for step, (got, want) in enumerate(zip(grads, ref)):
            for name, g in want.items():
                if g is None or (name.startswith("gated") and not GATED[step]):
                    # unused on every rank: None (a .grad kept from an earlier step: zero)
                    assert got[name] is None or not got[name].any(), (step, name)
                    continue
                # the float32 layer: its gradient summed over rows in another order in float32, where
                # terms cancel an element is off by a few ulps of its terms, not of itself (seen:
                # 2.3e-9 on an element of 7e-4, 2026-11-27); a bug here (a rank's share lost, not
                # divided) is off by a third or more
                rtol, atol = (1e-5, 1e-5 * g.abs().max().item()) if name.startswith("single") else (1e-10, 0.0)
                torch.testing.assert_close(got[name], g, rtol=rtol, atol=atol, msg=lambda m: f"{step} {name}: {m}")
