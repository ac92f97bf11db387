"""Loss scaling: the scaler's rule against torch's GradScaler and DeepSpeed's, and its bad inputs.

Every scaler comes through the seam (`tinyscale.precision.IMPLEMENTATIONS`; a learner's file
joins with TINYSCALE_IMPL_MIXED_PRECISION_SCALER=file.py:Class). The rule is pure logic, so
these tests need no processes: a scripted sequence of overflows in, scales and skips out.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tinyscale import ConfigError, EngineConfig
from tinyscale.precision import (
    IMPLEMENTATIONS,
    DynamicLossScaler,
    StaticLossScaler,
    make_loss_scaler,
)
from tinyscale.testing import implementations, resolve

SCALERS = implementations("mixed_precision_scaler", IMPLEMENTATIONS)
# GradScaler has no floor; ours must have one (> 0). This one is never reached by the
# sequences below (at most 40 halvings from 2^16), so it cannot change a trajectory.
NO_FLOOR = 2.0**-64

overflow_scripts = st.lists(st.booleans(), min_size=1, max_size=40)


def ours_trajectory(impl, overflows, **kwargs):
    """(scale used by the step, was it skipped) for each step, overflow found on a real tensor."""
    scaler = resolve(impl)(**kwargs)
    out = []
    for bad in overflows:
        grad = torch.full((3,), float("inf") if bad else 1.0)  # what backward left in .grad
        scale = scaler.scale
        overflow = scaler.found_overflow([grad], None)
        out.append((scale, scaler.update(overflow)))
    return out


def torch_trajectory(overflows, init_scale, window):
    """The same through torch.amp.GradScaler: skipped = the parameter did not move."""
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=window)
    out = []
    for bad in overflows:
        scale = scaler.get_scale()
        opt.zero_grad()
        scaler.scale((w * torch.tensor([float("inf") if bad else 1.0])).sum()).backward()
        before = w.detach().clone()
        scaler.step(opt)
        scaler.update()
        out.append((scale, torch.equal(w.detach(), before)))
    return out


@pytest.mark.parametrize("impl", SCALERS)
@given(overflows=overflow_scripts, power=st.integers(0, 16), window=st.integers(1, 6))
def test_mixed_precision_scaler_matches_torch_grad_scaler(impl, overflows, power, window):
    ours = ours_trajectory(impl, overflows, initial_scale_power=power, loss_scale_window=window, hysteresis=1,
                           min_loss_scale=min(NO_FLOOR, 2.0**power), growth="torch")
    assert ours == torch_trajectory(overflows, 2.0**power, window)


def deepspeed_trajectory(overflows, power, window, hysteresis, consecutive, min_scale):
    """DeepSpeed's DynamicLossScaler.update_scale, in its own formulation (an iteration
    counter, the iteration of the last overflow, and a modulo), written out independently.
    -k deepspeed_agreement runs DeepSpeed's own class on the same kind of scripts."""
    scale, hyst_left, last_overflow_it = 2.0**power, hysteresis, -1
    out = []
    for it, bad in enumerate(overflows):
        out.append((scale, bad))  # an overflowing step is always skipped
        if bad:
            if hysteresis == 1 or hyst_left == 1:
                scale = max(scale / 2, min_scale)
            else:
                hyst_left -= 1
            last_overflow_it = it
        else:
            if consecutive:
                hyst_left = hysteresis
            stable_interval = it - last_overflow_it - 1  # clean steps before this one
            if stable_interval > 0 and stable_interval % window == 0:
                if not consecutive:
                    hyst_left = hysteresis
                scale *= 2
    return out


@pytest.mark.parametrize("impl", SCALERS)
@given(overflows=overflow_scripts, power=st.integers(0, 16), window=st.integers(1, 6),
       hysteresis=st.integers(1, 4), consecutive=st.booleans())
def test_mixed_precision_scaler_follows_deepspeed_hysteresis(impl, overflows, power, window, hysteresis,
                                                             consecutive):
    kwargs = {"initial_scale_power": power, "loss_scale_window": window, "hysteresis": hysteresis,
                  "min_loss_scale": min(NO_FLOOR, 2.0**power), "consecutive_hysteresis": consecutive}
    ours = ours_trajectory(impl, overflows, **kwargs)
    assert ours == deepspeed_trajectory(overflows, power, window, hysteresis, consecutive, kwargs["min_loss_scale"])


# --8<-- [start:hysteresis-table]
# hysteresis 2, window 3, initial scale 2^4. O = overflow (skipped), . = clean step.
SCRIPT = "OOO....O.OO"
EXPECTED_SCALES = {
    # The first O only spends the spare; later ones halve. After three clean steps, the next
    # clean one doubles the scale and restores the spare (DeepSpeed grows on clean step W + 1
    # after an overflow). One clean step between overflows does not restore it...
    False: [16, 16, 8, 4, 4, 4, 4, 8, 8, 8, 4],
    # ...unless consecutive_hysteresis: then any clean step restores it (step 9 is tolerated).
    True: [16, 16, 8, 4, 4, 4, 4, 8, 8, 8, 8],
}
# --8<-- [end:hysteresis-table]


@pytest.mark.parametrize("impl", SCALERS)
@pytest.mark.parametrize("consecutive", [False, True])
def test_mixed_precision_hysteresis_worked_example(impl, consecutive):
    overflows = [c == "O" for c in SCRIPT]
    got = ours_trajectory(impl, overflows, initial_scale_power=4, loss_scale_window=3, hysteresis=2,
                          consecutive_hysteresis=consecutive)
    assert [s for s, _ in got] == EXPECTED_SCALES[consecutive]
    assert [skipped for _, skipped in got] == overflows


def test_mixed_precision_scaler_defaults_are_deepspeeds():
    s = DynamicLossScaler()
    assert (s.scale, s.window, s.hysteresis, s.min_scale, s.consecutive_hysteresis) == (2.0**16, 1000, 2, 1.0, False)
    cfg = EngineConfig.load({"train_batch_size": 8, "fp16": {"enabled": True}}).fp16
    built = make_loss_scaler(**cfg.model_dump(exclude={"enabled"}))
    assert isinstance(built, DynamicLossScaler) and built.state_dict() == s.state_dict()


def test_mixed_precision_scale_floors_at_min_then_raises():
    s = DynamicLossScaler(initial_scale_power=2, hysteresis=1, min_loss_scale=2.0)
    assert s.update(True) and s.scale == 2.0  # 4 -> 2, the floor
    with pytest.raises(FloatingPointError, match="minimum loss scale 2"):
        s.update(True)  # already at the floor: training has diverged, say so
    quiet = DynamicLossScaler(initial_scale_power=2, hysteresis=1, min_loss_scale=2.0, raise_at_min_scale=False)
    quiet.update(True)
    assert quiet.update(True) and quiet.scale == 2.0


def test_mixed_precision_static_scaler_skips_but_keeps_its_scale():
    s = make_loss_scaler(loss_scale=128.0)
    assert isinstance(s, StaticLossScaler)
    assert [s.update(bad) for bad in (True, False, True)] == [True, False, True]
    assert s.scale == 128.0 and s.overflows == 2


@pytest.mark.parametrize("impl", SCALERS)
def test_mixed_precision_scaler_state_dict_resumes_the_rule(impl):
    script = [c == "O" for c in "O..O.O....O..."]
    whole = ours_trajectory(impl, script, initial_scale_power=6, loss_scale_window=3)
    first = resolve(impl)(initial_scale_power=6, loss_scale_window=3)
    for bad in script[:5]:
        first.update(bad)
    second = resolve(impl)(initial_scale_power=6, loss_scale_window=3)
    second.load_state_dict(first.state_dict())
    resumed = [(second.scale, second.update(bad)) for bad in script[5:]]
    assert resumed == whole[5:]


def test_mixed_precision_found_overflow_sees_inf_and_nan_anywhere():
    s = DynamicLossScaler()
    ok = [torch.ones(4), None, torch.zeros(2, 2)]
    assert not s.found_overflow(ok)
    for bad in (float("inf"), float("-inf"), float("nan")):
        t = torch.ones(2, 3, dtype=torch.float16)
        t[1, 2] = bad
        assert s.found_overflow([*ok, t])
    assert not s.found_overflow([])  # nothing to check is not an overflow


def test_mixed_precision_unscale_refuses_fp16_and_divides_fp32():
    s = DynamicLossScaler(initial_scale_power=10)
    with pytest.raises(ValueError, match="float16"):
        s.unscale_([torch.ones(2, dtype=torch.float16)])
    g = torch.full((3,), 3.0 * 2**10)
    s.unscale_([g, None])
    assert torch.equal(g, torch.full((3,), 3.0))


@pytest.mark.parametrize("kwargs, field", [
    ({"initial_scale_power": -1}, "initial_scale_power"),
    ({"initial_scale_power": 65}, "initial_scale_power"),
    ({"initial_scale_power": 2.5}, "initial_scale_power"),
    ({"loss_scale_window": 0}, "loss_scale_window"),
    ({"hysteresis": 0}, "hysteresis"),
    ({"min_loss_scale": 0.0}, "min_loss_scale"),
    ({"min_loss_scale": 2.0**17}, "min_loss_scale"),
])
def test_mixed_precision_bad_scaler_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"fp16.{field}="):
        DynamicLossScaler(**kwargs)


@pytest.mark.parametrize("bad", [-1.0, float("inf")])
def test_mixed_precision_bad_static_scale_names_the_field(bad):
    with pytest.raises(ValueError, match="fp16.loss_scale="):
        make_loss_scaler(loss_scale=bad)


@pytest.mark.parametrize("fp16, field", [
    ({"hysteresis": 0}, "hysteresis"),
    ({"loss_scale_window": 0}, "loss_scale_window"),
    ({"min_loss_scale": 0}, "min_loss_scale"),
    ({"loss_scale": -1}, "loss_scale"),
    ({"initial_scale_power": 99}, "initial_scale_power"),
])
def test_mixed_precision_bad_config_values_raise_config_error(fp16, field):
    with pytest.raises(ConfigError, match=field):
        EngineConfig.load({"train_batch_size": 8, "fp16": {"enabled": True, **fp16}})
