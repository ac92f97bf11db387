"""BucketedDDP's tensor operations per synchronising backward: per bucket, not per parameter.

Each operation launched from Python between autograd's kernels costs far more than its bytes
(lesson 02, "Four ranks"), so the gradient hooks make none: a full bucket takes its gradients in
one `cat` and its division in one `div_`. Counted with a dispatch mode, as the difference
between a synchronising backward and the same backward under `no_sync` (autograd's own
operations cancel out).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from tinyscale.data import synthetic_token_batches
from tinyscale.data_parallel import BucketedDDP
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import CountOps, run_on_ranks


def _ops_of_sync(set_to_none: bool):
    """(operations a synchronising backward adds to the same backward under no_sync, buckets,
    parameters). Step 0 makes the gradients the buckets' views; the counted step 1 starts from
    .grad None (set_to_none) or from those views zeroed in place."""
    cfg = GPTConfig.preset("tiny")  # tied embeddings, kv heads < heads
    model = GPT(cfg, seed=0, dtype=torch.float64)
    ddp = BucketedDDP(model, bucket_cap_mb=0.05, first_bucket_cap_mb=0.01)
    ((x, y),) = synthetic_token_batches(num_batches=1, batch_size=2 * dist.get_world_size(), seq_len=16, seed=0)
    rows = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    counts = {}
    for sync in (True, False, True):  # the first: step 0
        model.zero_grad(set_to_none=set_to_none)
        loss = ddp(x[rows], y[rows])
        count = CountOps()
        with ddp.no_sync() if not sync else contextlib.nullcontext(), count:
            loss.backward()
        counts[sync] = count.ops
    added = counts[True] - counts[False]
    assert not counts[False] - counts[True]  # (no_sync adds nothing either)
    return dict(added), len(ddp.buckets), len(ddp.params)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_ddp_bucketed_sync_adds_two_operations_a_bucket_not_one_a_parameter(set_to_none):
    """Per synchronising backward, on 2 ranks: each bucket's all-reduce, one `cat` into the bucket
    (none where every .grad is its slot already) and one `div_` over it, whatever the number of
    parameters; besides them, the usage flags (their tensor, its copy into the last bucket, the
    test `> 0`), and for the `cat` each gradient seen flat (`view`: no data moved)."""
    for added, buckets, params in run_on_ranks(_ops_of_sync, 2, set_to_none):
        assert buckets >= 3 and params > 3 * buckets  # several buckets, several parameters in each
        per_bucket = {"c10d.allreduce_.default": buckets, "aten.cat.out": 0 if not set_to_none else buckets,
                      "aten.div_.Tensor": buckets}
        flags = {"aten.lift_fresh.default": 1, "aten.copy_.default": 1, "aten.gt.Scalar": 1}
        flat = {"aten.view.default": params if set_to_none else 0}
        assert added == {op: n for op, n in {**per_bucket, **flags, **flat}.items() if n}, added
