"""Data parallelism without the engine: parameters without a gradient train as in one process,
with no flag (`pytest -k unused`; the engine's tests are tests/zero/test_unused.py).

Ours find unused parameters always: BucketedDDP's usage flags ride in its last bucket's
all-reduce, NaiveDDP pays one small all-reduce. The model, data and reference are those of
tests/zero/test_unused.py (a layer no forward uses, a layer used on one rank, in one
micro-batch or in no step at all; frozen and tied weights; AdamW with weight decay).
"""

from __future__ import annotations

import contextlib

import pytest
import torch.distributed as dist

import tinyscale as ts
from tests.zero.test_unused import ACCUM, MICRO, USES_EXTRA, WORLD, UnusedMLP, batches, config, reference
from tinyscale.data_parallel import BucketedDDP, NaiveDDP
from tinyscale.dist import comm
from tinyscale.optim import build_optimizer
from tinyscale.testing import assert_state_dicts_close, run_on_ranks


def _train(impl):
    model, rank = UnusedMLP(), dist.get_rank()
    # 3000 bytes: several buckets, so the flags ride in one of many all-reduces
    ddp = NaiveDDP(model) if impl == "naive" else BucketedDDP(model, bucket_cap_mb=3000 / 2**20)
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad],
                                ts.EngineConfig.load(config(0)).optimizer)
    with comm.record() as ledger:
        for x, y in batches():
            for k in range(ACCUM):
                rows = slice((rank * ACCUM + k) * MICRO, (rank * ACCUM + k + 1) * MICRO)
                with ddp.no_sync() if k < ACCUM - 1 else contextlib.nullcontext():
                    (ddp(x[rows], y[rows]) / ACCUM).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return model.state_dict(), ledger.calls("all_reduce"), len(getattr(ddp, "buckets", []))


@pytest.mark.parametrize("impl", ["naive", "bucketed"])
def test_unused_parameters_data_parallel_without_a_flag(impl):
    ref_state = reference(len(USES_EXTRA))[1]
    params = sum(1 for p in UnusedMLP().parameters() if p.requires_grad)
    for state, calls, buckets in run_on_ranks(_train, WORLD, impl):
        assert_state_dicts_close(state, ref_state, what="parameters after training")
        # the cost: naive, one all-reduce per used parameter plus one for the flags; bucketed,
        # none beyond one per bucket (the flags ride in the last)
        if impl == "bucketed":
            assert buckets > 1 and calls == len(USES_EXTRA) * buckets
        else:
            assert calls <= len(USES_EXTRA) * (params + 1)
