"""tinyscale against DeepSpeed 0.19.8 itself: the same config, the same numbers.

DeepSpeed runs in a process of its own (`tinyscale.testing.deepspeed_peer`), so importing it
never touches this one. Each test sends DeepSpeed the whole batch of cases at once (one process
start) and compares every value.

    pytest -k deepspeed_agreement            # needs the `peers` extra: pip install -e ".[peers]"
"""

from __future__ import annotations

import itertools

import pytest

from tinyscale.config import EngineConfig
from tinyscale.optim import lr_at
from tinyscale.testing import deepspeed_peer

pytestmark = pytest.mark.skipif(not deepspeed_peer.available(),
                                reason="DeepSpeed is not installed: pip install -e '.[peers]' (make setup does)")


# --- learning-rate schedulers -------------------------------------------------------------------

def _schedule_cases() -> list[dict]:
    """Every scheduler type x warm-up shape x warm-up length (1 and 2 are the clamp's edge,
    None is the default 1000) x the type's own keys (given or left to their defaults) x two
    optimizer lrs: 320 parameter sets, each run 60 steps past its end."""
    cases = []
    for kind, warmup_type, warmup, lr in itertools.product(
            ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"), ("log", "linear"), (None, 1, 2, 37), (3e-4, 0.1)):
        base = {"warmup_type": warmup_type} | ({} if warmup is None else {"warmup_num_steps": warmup})
        w = warmup or 1000
        if kind == "WarmupCosineLR":
            own = [{}, {"warmup_min_ratio": 0.1}, {"cos_min_ratio": 0.2}, {"warmup_min_ratio": 0.3, "cos_min_ratio": 0}]
        else:
            own = [{}, {"warmup_min_lr": 1e-5}, {"warmup_max_lr": 5e-3}, {"warmup_min_lr": 2e-4, "warmup_max_lr": 2e-4}]
        totals = [None] if kind == "WarmupLR" else [w, 2 * w + 11]
        for params, total in itertools.product(own, totals):
            extra = {} if total is None else {"total_num_steps": total}
            cases.append({"type": kind, "lr": lr, "params": base | params | extra, "steps": (total or w) + 60})
    return cases


def _tinyscale_lrs(case: dict) -> list[float]:
    cfg = EngineConfig.load({"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": case["lr"]}},
                             "scheduler": {"type": case["type"], "params": case["params"]}})
    return [lr_at(step, cfg) for step in range(case["steps"])]


def test_deepspeed_agreement_schedulers_give_deepspeeds_lr_at_every_step():
    cases = _schedule_cases()
    theirs = deepspeed_peer.run("schedules", cases)
    differ = []
    for case, ds in zip(cases, theirs):
        ours = _tinyscale_lrs(case)
        # equal, not close: lr_at does DeepSpeed's arithmetic in DeepSpeed's order
        bad = [step for step, (a, b) in enumerate(zip(ours, ds)) if a != b]
        if bad:
            differ.append(f"{case['type']} lr {case['lr']} {case['params']}: first at step {bad[0]}, "
                          f"tinyscale {ours[bad[0]]!r} DeepSpeed {ds[bad[0]]!r}")
    assert len(cases) == 320 and not differ, f"{len(differ)} of {len(cases)} differ:\n" + "\n".join(differ[:10])


# --- the fp16 loss scaler -----------------------------------------------------------------------
# DeepSpeed refuses fp16 on this CPU ("Type fp16 is not supported on your device": its CPU
# accelerator allows fp16 only where oneDNN has fp16 kernels), so its engine cannot run an fp16
# step here. What decides the trajectory is its scaler's update rule, and that is plain Python:
# the peer drives DeepSpeed's own DynamicLossScaler (ZeRO stages 1-3) and FP16_Optimizer's
# _update_scale (stage 0) with scripted overflows, as their step() calls them.

def _scaler_cases() -> list[dict]:
    """240 overflow scripts of 60 steps over the fp16 keys: windows 1-5, hysteresis 1-3,
    consecutive or not, overflow rates from rare to most steps, floors reached and not."""
    import random

    rng = random.Random(27)
    cases = []
    for i in range(240):
        power = rng.choice([0, 1, 2, 4, 8, 16])
        f = {"initial_scale_power": power, "loss_scale_window": rng.randint(1, 5), "hysteresis": rng.randint(1, 3),
             "consecutive_hysteresis": rng.random() < 0.5, "min_loss_scale": 2 ** rng.randint(0, power)}
        rate = (0.05, 0.2, 0.4, 0.7)[i % 4]
        cases.append({"fp16": f, "overflows": [rng.random() < rate for _ in range(60)]})
    return cases


def _tinyscale_scales(case: dict, **override) -> dict:
    from tinyscale.precision import DynamicLossScaler

    f = case["fp16"] | override
    scaler = DynamicLossScaler(**f)
    scales, raised_at = [], None
    for step, overflow in enumerate(case["overflows"]):
        scales.append(scaler.scale)
        try:
            scaler.update(overflow)
        except FloatingPointError:
            raised_at = step
            break
    return {"scales": scales, "raised_at": raised_at}


def test_deepspeed_agreement_loss_scaler_follows_deepspeeds_zero_path_and_shows_stage0s_quirk():
    cases = _scaler_cases()
    theirs = deepspeed_peer.run("scalers", cases)
    zero_differ = [i for i, (c, ds) in enumerate(zip(cases, theirs)) if _tinyscale_scales(c) != ds["zero"]]
    assert not zero_differ, f"{len(zero_differ)} of {len(cases)} differ from DeepSpeed's ZeRO scaler, e.g. " \
                            f"{cases[zero_differ[0]]} -> {theirs[zero_differ[0]]['zero']}"
    assert sum(ds["zero"]["raised_at"] is not None for ds in theirs) >= 20  # the floor is exercised
    # Stage 0's FP16_Optimizer ignores hysteresis and skips for ever at the floor: it is our
    # rule with hysteresis 1 that never raises. tinyscale keeps one rule at every stage (the
    # config's hysteresis honoured, an overflow at the floor raising), so a DeepSpeed stage-0
    # fp16 run with hysteresis > 1 halves sooner than ours; docs/deepspeed-config.md says so.
    stage0_differ = [i for i, (c, ds) in enumerate(zip(cases, theirs))
                     if _tinyscale_scales(c, hysteresis=1, raise_at_min_scale=False) != ds["stage0"]]
    assert not stage0_differ, f"{len(stage0_differ)} of {len(cases)} differ from DeepSpeed's stage-0 scaler"
    quirk = sum(ds["stage0"] != ds["zero"] for ds in theirs)
    assert quirk >= len(cases) // 2  # the two DeepSpeed paths really disagree, on most scripts


def test_deepspeed_agreement_growth_step_unscales_with_the_scale_that_scaled_the_loss():
    """Which is right on a growth step: DeepSpeed updates the scale before it unscales, so the
    step that doubles S divides gradients made with S by 2S. SGD (lr 1) on w . x from w = 0:
    the true update is -x every step. Window 1 makes every clean step after the first a growth
    step. Found running DeepSpeed: its stage 0 in fp16 does not scale the loss in
    engine.backward at all (only ZeRO optimizers' scale_if_loss does), yet unscales by S."""
    import torch

    from tinyscale.precision import DynamicLossScaler, MixedPrecisionOptimizer

    x = [0.125, 0.25, 0.375, 0.5]  # |x| < 1 and exact in fp16: no clipping, no rounding
    fp16 = {"initial_scale_power": 4, "loss_scale_window": 1, "hysteresis": 1}
    theirs = deepspeed_peer.run("fp16_growth", {"x": x, "steps": 3, "fp16": fp16, "stages": [0, 1]}, timeout_s=900)
    w = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    mp = MixedPrecisionOptimizer([w], lambda g: torch.optim.SGD(g, lr=1.0), dtype=torch.float16,
                                 loss_scaler=DynamicLossScaler(**fp16))
    ours, scales = [], []
    for _ in range(3):
        before = w.detach().float().clone()
        scales.append(mp.loss_scale)
        mp.backward((w * torch.tensor(x, dtype=torch.float16)).sum())
        mp.step()
        mp.zero_grad()
        ours.append((w.detach().float() - before).tolist())
    minus_x = [-v for v in x]
    assert scales == [16, 16, 32] and mp.loss_scale == 64  # it grew on steps 1 and 2 (DeepSpeed's rule)...
    assert ours == [minus_x] * 3  # ...and every step applied the true gradient
    assert theirs["1"] == [minus_x] + [[v / 2 for v in minus_x]] * 2  # DeepSpeed ZeRO: growth steps halve it
    # stage 0: gradients never multiplied by S, then divided by the S after this step's update
    assert theirs["0"] == [[v / s for v in minus_x] for s in (16, 32, 64)]
