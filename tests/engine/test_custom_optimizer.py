"""Your own optimizer in the engine (`pytest -k custom_optimizer`; DS-36; lesson 03,
"Bring your own optimizer"; the contract: `tinyscale.optim.optimizer_factory`).

`ts.initialize(model, config, optimizer=...)` takes a `torch.optim.Optimizer` subclass or a
callable `groups -> Optimizer`. With an elementwise optimizer (torch's Adagrad; Lion, written
here, with decoupled weight decay) it trains exactly as `ts.reference.train` with the same
optimizer, at every ZeRO stage and with the optimizer offloaded, on the model with unused,
data-dependent, frozen and tied parameters, 3 ranks, float64, rtol 1e-10. An optimizer whose
state is not shaped like its parameter is refused under ZeRO; one whose update uses a
whole-tensor norm (LARS) is not detectable and trains differently there: the documented
limit, shown.
"""

from __future__ import annotations

import functools

import pytest
import torch

import tinyscale as ts
from tinyscale.config import ConfigError
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks
from tests.zero.test_unused import MICRO, ROWS, WORLD, UnusedMLP, batches


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): the update is the sign of an interpolation of momentum and
    gradient; elementwise, one state tensor per parameter. Skips parameters without a grad."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


class RunningNorm(Lion):
    """Keeps a 1-element running gradient norm per tensor: a state ZeRO cannot shard."""

    @torch.no_grad()
    def step(self):
        super().step()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p].setdefault("norm", torch.zeros(1, dtype=p.dtype)).add_(p.grad.norm())


class Lars(torch.optim.SGD):
    """SGD whose step is scaled per tensor by ||p|| / ||grad||: elementwise state, but not an
    elementwise update (the norms are of the whole tensor, or under ZeRO of a piece)."""

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(p.norm() / (p.grad.norm() + 1e-12))
        super().step()


OPTIMIZERS = {
    "lion": functools.partial(Lion, lr=3e-3, weight_decay=0.1),
    "adagrad": torch.optim.Adagrad,  # a class, built with its defaults (lr 0.01)
    "running_norm": functools.partial(RunningNorm, lr=3e-3),
    "lars": functools.partial(Lars, lr=0.05),
}
LAYOUTS = {"stage0": {"stage": 0}, "stage1": {"stage": 1}, "stage2": {"stage": 2}, "stage3": {"stage": 3},
           "stage2_offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


def _config(zero: dict, scheduler: dict | None = None) -> dict:
    config = {"train_batch_size": ROWS, "train_micro_batch_size_per_gpu": MICRO,
              "zero_optimization": {**zero, "reduce_bucket_size": 100}}  # several units and buckets
    return config if scheduler is None else {**config, "scheduler": scheduler}


def _train(zero: dict, name: str, scheduler: dict | None = None):
    engine = ts.initialize(UnusedMLP(), _config(zero, scheduler), optimizer=OPTIMIZERS[name])
    losses = [engine.train_batch(b) for b in batches()]
    return losses, engine.full_state_dict(), [g["lr"] for g in engine.optimizer.param_groups]


def _reference(name: str, scheduler: dict | None = None):
    model = UnusedMLP()
    losses = ts.reference.train(model, batches(), _config({"stage": 0}, scheduler), optimizer=OPTIMIZERS[name])
    return losses, model.state_dict()


@pytest.mark.parametrize("name", ["lion", "adagrad"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_custom_optimizer_trains_as_one_process(layout, name):
    ref_losses, ref_state = _reference(name)
    for losses, state, _ in run_on_ranks(_train, WORLD, LAYOUTS[layout], name):
        assert_losses_close(losses, ref_losses)
        assert_state_dicts_close(state, ref_state)


def test_custom_optimizer_keeps_its_lr_unless_the_config_schedules_it():
    # no scheduler: Lion's own 3e-3 (not the config's default optimizer lr, 1e-3)
    assert set(run_on_ranks(_train, 2, {"stage": 1}, "lion")[0][2]) == {3e-3}
    warmup = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02,
                                             "warmup_num_steps": 8, "warmup_type": "linear"}}
    ref_losses, ref_state = _reference("lion", warmup)
    for losses, state, lrs in run_on_ranks(_train, 2, {"stage": 1}, "lion", warmup):
        assert set(lrs) == {0.02 * 2 / 8}  # the 4th step's (step 3) lr: i = 2 of a linear warm-up over 8 (DeepSpeed's k - 1)
        assert_losses_close(losses, ref_losses)
        assert_state_dicts_close(state, ref_state)


@pytest.mark.parametrize("stage", [0, 2])
def test_custom_optimizer_schedule_scales_the_optimizer_s_own_lr(stage):
    """DeepSpeed's schedulers read the lr of the optimizer they wrap: WarmupLR's default peak and
    WarmupCosineLR's scale are Lion's own 3e-3 here, not the config's default optimizer lr (1e-3,
    which tinyscale used, 3x too low). Step 3 (the 4th): i = 2 of a linear warm-up over 8."""
    warmup = {"type": "WarmupLR", "params": {"warmup_num_steps": 8, "warmup_type": "linear"}}
    cosine = {"type": "WarmupCosineLR", "params": {"total_num_steps": 20, "warmup_num_steps": 8,
                                                   "warmup_type": "linear"}}
    for scheduler, expected in ((warmup, 3e-3 * 2 / 8), (cosine, 3e-3 * 2 / 8)):
        ref_losses, ref_state = _reference("lion", scheduler)
        for losses, state, lrs in run_on_ranks(_train, 2, {"stage": stage}, "lion", scheduler):
            assert lrs and all(lr == pytest.approx(expected, rel=1e-12) for lr in lrs), (scheduler["type"], lrs)
            assert_losses_close(losses, ref_losses)
            assert_state_dicts_close(state, ref_state)


def test_custom_optimizer_schedule_refuses_groups_with_different_lrs():
    def two_lrs(groups):
        params = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
        return torch.optim.SGD([{"params": params[:1], "lr": 0.1}, {"params": params[1:], "lr": 0.01}])
    warmup = {"type": "WarmupLR", "params": {"warmup_num_steps": 8}}
    with pytest.raises(ConfigError, match=r"different learning rates \[0.01, 0.1\]"):
        ts.initialize(UnusedMLP(), _config({"stage": 0}, warmup), optimizer=two_lrs)
    ts.initialize(UnusedMLP(), _config({"stage": 0}), optimizer=two_lrs)  # no schedule: their own lrs stand


def test_custom_optimizer_refused_with_a_config_optimizer_or_a_bad_factory():
    config = {**_config({"stage": 0}), "optimizer": {"type": "SGD"}}
    with pytest.raises(ConfigError, match="'optimizer' and initialize"):
        ts.initialize(UnusedMLP(), config, optimizer=Lion)
    with pytest.raises(TypeError, match="Optimizer subclass or a callable"):
        ts.initialize(UnusedMLP(), _config({"stage": 0}), optimizer="Lion")
    with pytest.raises(TypeError, match="returned list, not a torch.optim.Optimizer"):
        ts.initialize(UnusedMLP(), _config({"stage": 0}), optimizer=lambda groups: groups)


def _first_step(zero: dict, name: str):
    engine = ts.initialize(UnusedMLP(), _config(zero), optimizer=OPTIMIZERS[name])
    try:
        engine.train_batch(batches()[0])
    except ValueError as err:
        return str(err)
    return None


def test_custom_optimizer_with_unshardable_state_is_refused_under_zero():
    assert _first_step({"stage": 0}, "running_norm") is None  # DDP: whole tensors, any state
    for message in run_on_ranks(_first_step, 2, {"stage": 1}, "running_norm"):
        assert "keeps state 'norm' of shape (1,)" in message and "stage 0" in message


def test_custom_optimizer_with_a_per_tensor_norm_trains_differently_under_zero():
    """The contract's undetectable case: LARS matches one process under DDP, not under ZeRO."""
    ref_losses, ref_state = _reference("lars")
    ddp = run_on_ranks(_train, WORLD, {"stage": 0}, "lars")[0]
    assert_state_dicts_close(ddp[1], ref_state)
    zero1 = run_on_ranks(_train, WORLD, {"stage": 1}, "lars")[0]
    with pytest.raises(AssertionError):
        assert_state_dicts_close(zero1[1], ref_state)
