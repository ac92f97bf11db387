"""Expert shards (`parallel.expert` > 1) under the engine's other step features
(`pytest -k "moe_engine_steps"`; the topics' keys are in each name).

- DDP's expert all-reduce honours `communication_data_type`, `prescale_gradients` and
  `gradient_predivide_factor` as the dense buckets do: an expert shard and a dense twin given
  the same gradients get the same reduced gradient bit for bit, and the ledger's expert bytes
  are in the comm dtype (`-k expert_comm`).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tinyscale.data_parallel import BucketedDDP
from tinyscale.dist import comm
from tinyscale.moe.parallel import ExpertShard
from tinyscale.testing import run_on_ranks

# --- 1. the expert all-reduce in the comm dtype, pre- and post-divided as the buckets are

SHAPE = (3, 5)


class _Twins(nn.Module):
    """A dense parameter and an expert shard over the whole world (edp = dp, mean over dp): the
    same gradient into each, so DDP's bucket path and its expert path must agree exactly."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Parameter(torch.zeros(SHAPE, dtype=torch.float64))
        self.expert = nn.Parameter(torch.zeros(SHAPE, dtype=torch.float64))
        self.expert.expert_shard = ExpertShard(group=dist.group.WORLD, mean_over=dist.get_world_size(),
                                               experts=(0, 1), num_experts=1)

    def forward(self, x):
        return (self.dense * x).sum() + (self.expert * x).sum()


def _reduce_twins(comm_dtype, prescale: bool, factor: float):
    torch.manual_seed(11 + dist.get_rank())
    # float64 values that fp16 and bf16 round, some near fp16's largest (65504): their sum
    # overflows fp16 unless each rank divided by N first, as prescale_gradients does
    x = torch.randn(SHAPE, dtype=torch.float64) / 3
    x[0, :2] = 4.0e4 + dist.get_rank()
    ddp = BucketedDDP(_Twins())
    ddp.comm_dtype, ddp.prescale_gradients, ddp.gradient_predivide_factor = comm_dtype, prescale, factor
    with comm.record() as ledger:
        ddp(x).backward()
    rows = [r.bytes for r in ledger.rows if r.op == "all_reduce"]
    return ddp.module.dense.grad, ddp.module.expert.grad, rows


@pytest.mark.parametrize("comm_dtype", [None, torch.float16, torch.bfloat16], ids=["fp64", "fp16", "bf16"])
@pytest.mark.parametrize("prescale,factor", [(True, 1.0), (False, 1.0), (False, 3.0)],
                         ids=["prescale", "sum-then-divide", "predivide-3"])
def test_moe_engine_steps_expert_comm_follows_the_bucket_semantics(comm_dtype, prescale, factor):
    """World 4 (the predivide factor 3 divides nothing exactly): the expert shard's reduced gradient equals its dense
    twin's bit for bit on every rank, infs where fp16 overflows included, and the ledger's last
    all-reduce is the expert's, of 15 elements in the comm dtype."""
    out = run_on_ranks(_reduce_twins, 4, comm_dtype, prescale, factor)
    size = torch.finfo(comm_dtype or torch.float64).bits // 8
    for rank, (dense, expert, rows) in enumerate(out):
        assert torch.equal(dense, expert), (rank, dense - expert)
        assert rows[-1] == SHAPE[0] * SHAPE[1] * size, (rank, rows)
    dense = out[0][0]
    # not vacuous: fp16 overflows where the four ~4e4 terms are divided by less than 2.45 before
    # their sum (65504 is fp16's largest), and the formats round the float64 sum
    pre = 4 if prescale else factor
    assert bool(torch.isinf(dense).any()) == (comm_dtype is torch.float16 and 4 * 4.0e4 / pre > 65504)
    if comm_dtype is not None:
        exact = sum(_rank_grad(r) for r in range(4)) / 4
        assert not torch.equal(dense, exact)


def _rank_grad(rank: int) -> torch.Tensor:
    torch.manual_seed(11 + rank)
    x = torch.randn(SHAPE, dtype=torch.float64) / 3
    x[0, :2] = 4.0e4 + rank
    return x
