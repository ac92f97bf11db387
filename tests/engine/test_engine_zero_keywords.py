"""`overlap_comm` and `reduce_bucket_size` mean at stages 1 and 3 what they mean in DeepSpeed
(`pytest -k zero_keywords`): stage 1 reduce-scatters in units of at most reduce_bucket_size
elements; stage 3 prefetches (overlaps the next unit's all-gather with compute) only with
overlap_comm. Training is the same either way (float64, against the reference)."""

from __future__ import annotations

import pytest

import tinyscale as ts
from tinyscale.data import synthetic_regression_batches
from tinyscale.models import TinyMLP
from tinyscale.testing import assert_state_dicts_close, run_on_ranks
from tinyscale.zero import split_into_units


def _config(stage, **zero):
    return {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage, **zero}}


def _run(stage, zero):
    engine = ts.initialize(TinyMLP(seed=0), _config(stage, **zero),
                           **({"zero3_wrap": ["shared", "frozen"]} if stage == 3 else {}))
    batches = synthetic_regression_batches(num_batches=2, batch_size=4, dim=8, seed=0)
    engine.comm_ledger.clear()
    for b in batches:
        engine.train_batch(b)
    kinds = {kind for kind, _, _ in engine.zero.events} if stage == 3 else set()
    return engine.full_state_dict(), engine.comm_ledger.calls("reduce_scatter"), kinds


@pytest.mark.parametrize("bucket", [100, 500_000_000])
def test_zero_keywords_stage1_reduce_bucket_size(bucket):
    trainable = [p for p in TinyMLP().parameters() if p.requires_grad]
    units = split_into_units(trainable, 8 * bucket, 2, 0)  # float64: 8 bytes per element
    ref_model = TinyMLP(seed=0)
    ts.reference.train(ref_model, synthetic_regression_batches(num_batches=2, batch_size=4, dim=8, seed=0),
                       _config(1, reduce_bucket_size=bucket))
    for state, reduce_scatters, _ in run_on_ranks(_run, 2, 1, {"reduce_bucket_size": bucket}):
        assert reduce_scatters == 2 * len(units)  # one per unit per step
        assert_state_dicts_close(state, ref_model.state_dict())
    assert (len(units) > 1) == (bucket == 100)


@pytest.mark.parametrize("overlap", [True, False])
def test_zero_keywords_stage3_overlap_comm_is_prefetch(overlap):
    results = run_on_ranks(_run, 2, 3, {"overlap_comm": overlap})
    for state, _, kinds in results:
        assert ("prefetch" in kinds) == overlap
        assert all((state[k] == results[0][0][k]).all() for k in state)
