"""DeepSpeed's prescale_gradients and gradient_predivide_factor (issue 17): what each rank sends
is its gradient divided by dp (prescale), by the factor (postscale, divided by dp / factor
after the sum), or undivided (DeepSpeed's default: sum, then divide). Shown where it matters,
an fp16 sum near fp16's max, and in float64 still the training of one process.
`pytest -k deepspeed_config_prescale`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tinyscale as ts
from tinyscale import EngineConfig
from tinyscale.config_deepspeed import gradient_scaling
from tinyscale.data import synthetic_regression_batches
from tinyscale.data_parallel import BucketedDDP
from tinyscale.models import TinyMLP
from tinyscale.zero import ZeroStage1

BIG = 40000.0  # < 65504 (fp16's max); 2 x BIG is not


class _Scaled(nn.Module):
    """loss = sum(w * x): the gradient of w is x, exactly, in fp16."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(6, dtype=torch.float16))

    def forward(self, x):
        return (self.w * x).sum()


def _reduced(kind, prescale, factor):
    model, x = _Scaled(), torch.full((6,), BIG, dtype=torch.float16)
    if kind == "bucketed":
        ddp = BucketedDDP(model)
        ddp.prescale_gradients, ddp.gradient_predivide_factor = prescale, factor
        ddp(x).backward()
        return model.w.grad.clone()
    zero = ZeroStage1(model.parameters(), lambda groups: torch.optim.SGD(groups, lr=0.0))
    zero.sharded.prescale_gradients, zero.sharded.gradient_predivide_factor = prescale, factor
    model(x).backward()
    zero.reduce_gradients()
    return zero.sharded.grad[0].clone()  # this rank's 3 of the 6 elements


@pytest.mark.parametrize("kind", ["bucketed", "zero1"])
def test_deepspeed_config_prescale_gradients_decides_what_the_fp16_sum_holds(kind):
    from tinyscale.testing import run_on_ranks

    for prescale, factor, finite in ((True, 1.0, True),    # BIG / 2 on each rank: the sum is BIG
                                     (False, 1.0, False),  # DeepSpeed's default: BIG + BIG = inf in fp16
                                     (False, 2.0, True)):  # BIG / 2 + BIG / 2, then x 2 / 2
        for grad in run_on_ranks(_reduced, 2, kind, prescale, factor):
            expected = torch.full_like(grad, BIG if finite else float("inf"))
            assert grad.dtype == torch.float16 and torch.equal(grad, expected), (prescale, factor, grad)


def test_deepspeed_config_prescale_gradients_default_follows_deepspeed_where_the_factor_asks():
    def scaling(**keys):
        return gradient_scaling(EngineConfig.load({"train_batch_size": 4, **keys}))
    assert scaling() == (True, 1.0)  # tinyscale's default: divide before the sum
    assert scaling(gradient_predivide_factor=2.0) == (False, 2.0)  # DeepSpeed's default with a factor
    assert scaling(prescale_gradients=False) == (False, 1.0)
    engine = ts.initialize(TinyMLP(seed=0), {"train_batch_size": 4, "prescale_gradients": True,
                                             "gradient_predivide_factor": 2.0})
    assert any("gradient_predivide_factor: no effect with prescale_gradients true" in n for n in engine.config_notes)


_CONFIG = {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 1,  # 3 ranks: 2 micro-batches
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}


def _train(stage, keys):
    engine = ts.initialize(TinyMLP(seed=0), {**_CONFIG, "zero_optimization": {"stage": stage}, **keys})
    for batch in synthetic_regression_batches(num_batches=2, batch_size=6, dim=8, seed=0):
        engine.train_batch(batch)
    return engine.full_state_dict()


def _variants(stage):
    return [_train(stage, keys) for keys in ({"prescale_gradients": False}, {"gradient_predivide_factor": 2.0})]


@pytest.mark.parametrize("stage", [0, 1])
def test_deepspeed_config_prescale_gradients_false_trains_like_one_process_float64(stage):
    from tinyscale.testing import assert_state_dicts_close, run_on_ranks

    reference = TinyMLP(seed=0)
    ts.reference.train(reference, synthetic_regression_batches(num_batches=2, batch_size=6, dim=8, seed=0), _CONFIG)
    for states in run_on_ranks(_variants, 3, stage):  # 3 ranks: dividing by 3 before or after rounds differently
        for state in states:
            assert_state_dicts_close(state, reference.state_dict())  # float64, rtol 1e-10
