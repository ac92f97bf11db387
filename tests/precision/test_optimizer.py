"""MixedPrecisionOptimizer in one process: what fp32 masters buy, how closely fp16/bf16 training
tracks fp32 (with the tolerance derived below), skipped steps, bytes, and resuming.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tinyscale.data import synthetic_regression_batches, synthetic_token_batches
from tinyscale.models import GPT, GPTConfig, TinyMLP
from tinyscale.precision import (
    DynamicLossScaler,
    MixedPrecisionOptimizer,
    StaticLossScaler,
)

LOW = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]


def sgd(lr):
    return lambda groups: torch.optim.SGD(groups, lr=lr)


def unit_roundoff(dtype) -> float:
    """u: the largest relative error of one rounding to nearest (half the spacing at 1)."""
    return torch.finfo(dtype).eps / 2


# ---------------------------------------------------------------------------------------------
# The fp32 path is the plain optimizer, bit for bit
# ---------------------------------------------------------------------------------------------

@given(seed=st.integers(0, 2**16), power=st.integers(0, 24), window=st.sampled_from([1, 2, 1000]),
       max_norm=st.sampled_from([0.0, 0.05, 10.0]), kind=st.sampled_from(["adamw", "sgd"]))
def test_mixed_precision_fp32_path_is_bit_identical_to_plain_training(seed, power, window, max_norm, kind):
    """dtype=float32: masters = parameters, and a power-of-two scale is exact (only exponents
    change), so scale, unscale, clip and copy-back must leave plain training unchanged, bit for
    bit. Catches an unscale by the wrong scale (window 1: the scale doubles after every step, so
    unscaling after update() is off by 2), a clip on scaled gradients, a missed copy-back."""
    make = (lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.1)) if kind == "adamw" else sgd(0.1)
    batches = synthetic_regression_batches(num_batches=4, batch_size=6, dim=8, seed=seed, dtype=torch.float32)
    plain, mixed = TinyMLP(seed=seed, dtype=torch.float32), TinyMLP(seed=seed, dtype=torch.float32)
    opt = make([p for p in plain.parameters() if p.requires_grad])
    mp = MixedPrecisionOptimizer(mixed.parameters(), make, dtype=torch.float32,
                                 loss_scaler=DynamicLossScaler(initial_scale_power=power, loss_scale_window=window))
    for x, y in batches:
        plain(x, y).backward()
        if max_norm:
            torch.nn.utils.clip_grad_norm_([p for p in plain.parameters() if p.requires_grad], max_norm)
        opt.step()
        opt.zero_grad()
        mp.backward(mixed(x, y))
        assert not mp.step(max_norm=max_norm)
        mp.zero_grad()
    for (name, a), b in zip(plain.named_parameters(), mixed.parameters()):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------
# fp32 masters keep the updates a low-precision parameter loses
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", LOW)
def test_mixed_precision_master_weights_keep_a_tiny_update(dtype):
    """w = 1, SGD with lr 1 and gradient delta, a quarter of the spacing of numbers just below 1
    (2^-11 in fp16, 2^-8 in bf16): in the low format w - delta rounds back to 1 every step, so a
    pure-fp16/bf16 parameter never moves. The fp32 master accumulates the 64 updates."""
    steps = 64
    delta = torch.finfo(dtype).eps / 8  # eps/2 = spacing just below 1; delta = half of half of it
    grad = torch.full((16,), delta, dtype=dtype)

    pure = torch.nn.Parameter(torch.ones(16, dtype=dtype))
    pure_opt = torch.optim.SGD([pure], lr=1.0)
    for _ in range(steps):
        pure.grad = grad.clone()
        pure_opt.step()
    assert torch.equal(pure, torch.ones(16, dtype=dtype)), "pure low precision should lose every update"

    w = torch.nn.Parameter(torch.ones(16))
    mp = MixedPrecisionOptimizer([w], sgd(1.0), dtype=dtype)
    for _ in range(steps):
        w.grad = grad.clone()
        mp.step()
    expected = 1.0 - steps * float(grad[0])  # 1 - 64 delta = 1 - 8 eps: exact in fp32 and in `dtype`
    # Each fp32 subtraction of a power of two from a value in [0.99, 1] is exact here: 0 error.
    assert torch.equal(mp.masters[0], torch.full((16,), expected))
    assert torch.equal(w.detach(), torch.full((16,), expected, dtype=dtype))  # the model sees it too


# ---------------------------------------------------------------------------------------------
# fp16 and bf16 training track fp32: the tolerance, derived
# ---------------------------------------------------------------------------------------------

# --8<-- [start:rounding-count]
# Roundings on the tiny GPT's forward path, one per tensor written in the low format or weight
# read from it: embedding 1; per block 19 (attn_norm output and weight 2, wq weight and
# output 2, rope 1, attention 2, wo 2, residual add 1, mlp_norm 2, w_gate 2, silu 1, product 1,
# w_down 2, residual add 1); final norm 2, head 2.
FORWARD_ROUNDINGS = 1 + 2 * 19 + 4  # = 43 for n_layer = 2
# A weight's gradient reads activations carrying the forward's errors and a gradient that
# came back through the same chain, each op rounding what it writes: twice as many.
BACKWARD_ROUNDINGS = 2 * FORWARD_ROUNDINGS


def relative_error_tolerance(roundings: int, u: float) -> float:
    """Each rounding multiplies a value by (1 + d), d spread over [-u, u]: mean 0, variance
    u^2 / 3, independent of the others (Higham and Mary, SIAM J. Sci. Comput. 2019). To first
    order R of them give a relative error of variance R u^2 / 3. We allow 4 standard deviations
    (for one element; a norm over thousands of elements concentrates far more tightly)."""
    return 4 * math.sqrt(roundings / 3) * u
# --8<-- [end:rounding-count]


def _fp32_at(model32, masters, x, y):
    """Loss, flat gradient and max |logit| of the fp32 model at the given (fp32) weights."""
    with torch.no_grad():
        for p, m in zip(model32.parameters(), masters):
            p.copy_(m)
    model32.zero_grad(set_to_none=True)
    loss = model32(x, y)
    loss.backward()
    with torch.no_grad():
        max_logit = model32(x).abs().max().item()
    return loss.item(), torch.cat([p.grad.flatten() for p in model32.parameters()]), max_logit


@pytest.mark.parametrize("dtype", LOW)
def test_mixed_precision_tiny_gpt_tracks_fp32_within_derived_tolerance(dtype):
    """Train the tiny GPT with plain SGD (lr 0.1, 5 steps) in fp32 (the reference: weights
    theta_k, gradients g_k) and in `dtype` with fp32 masters (theta^_k, g^_k); at every step:

    1. Same weights, one forward/backward (nothing compounds). With u the unit roundoff and
       tol(R) = 4 sqrt(R / 3) u the relative error of R roundings (`relative_error_tolerance`):
         |L^(theta^) - L(theta^)|    <= 2 tol(R_fwd) max|z|   cross-entropy moves by at most
                                                             2 max|dz| (its gradient in the
                                                             logits z, p - onehot, has 1-norm <= 2)
         ||g^(theta^) - g(theta^)||  <= tol(R_bwd) ||g(theta^)||
    2. The trajectories. SGD: theta^_{k+1} - theta_{k+1} = (theta^_k - theta_k) - lr (g^_k - g_k),
       and g^_k - g_k = [g^(theta^_k) - g(theta^_k)] + [g(theta^_k) - g(theta_k)], the second
       of size lambda_k ||theta^_k - theta_k|| (lambda_k measured: the ratio of those norms).
       By the triangle inequality, with B_0 = 0 (the masters start as exact copies):
         ||theta^_k - theta_k|| <= B_k,   B_{k+1} = (1 + lr lambda_k) B_k + lr tol(R_bwd) ||g(theta^_k)||
       The losses then differ by the forward error plus the loss's change over a distance B_k:
       ||g|| B_k to first order; we allow 2 ||g(theta_k)|| B_k and assert lambda_k B_k <= ||g(theta_k)||
       (the gradient changes by less than itself over that distance), so the factor 2 holds.
    SGD, not Adam: its update is linear in g, so errors propagate as written, and a missing
    unscale (g x 2^16) shows; Adam's g / sqrt(v) would hide it. A skipped step would make the
    runs differ by a whole update, so the test asserts none happened.
    """
    cfg, lr, steps = GPTConfig.preset("tiny"), 0.1, 5
    u = unit_roundoff(dtype)
    tol_fwd, tol_bwd = relative_error_tolerance(FORWARD_ROUNDINGS, u), relative_error_tolerance(BACKWARD_ROUNDINGS, u)
    batches = synthetic_token_batches(num_batches=steps, batch_size=4, seq_len=32, seed=3)
    ref, model32, model = GPT(cfg, seed=0), GPT(cfg, seed=0), GPT(cfg, seed=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    scaler = DynamicLossScaler() if dtype == torch.float16 else None
    mp = MixedPrecisionOptimizer(model.parameters(), sgd(lr), dtype=dtype, loss_scaler=scaler)
    start = torch.cat([p.detach().flatten() for p in ref.parameters()])
    first_loss, bound = None, 0.0
    for k, (x, y) in enumerate(batches):
        loss_mp = model(x, y)
        mp.backward(loss_mp)
        g_mp = torch.cat([p.grad.flatten().float() for p in model.parameters()]) / mp.loss_scale
        loss_at_mp, g_at_mp, max_logit = _fp32_at(model32, mp.masters, x, y)
        loss_ref = ref(x, y)
        loss_ref.backward()
        first_loss = loss_ref.item() if first_loss is None else first_loss
        g_ref = torch.cat([p.grad.flatten() for p in ref.parameters()])

        # 1. one step, same weights
        fwd_err = 2 * tol_fwd * max_logit
        assert abs(loss_mp.item() - loss_at_mp) <= fwd_err, (k, loss_mp.item(), loss_at_mp, fwd_err)
        rel = (g_mp - g_at_mp).norm().item() / g_at_mp.norm().item()
        assert rel <= tol_bwd, (k, rel / u, tol_bwd / u)
        # 2. the trajectories
        dist = torch.cat([(m - p.detach()).flatten() for m, p in zip(mp.masters, ref.parameters())]).norm().item()
        assert dist <= bound * (1 + 1e-5) + 1e-7, (k, dist, bound)  # slack: fp32 rounding of the norms
        assert abs(loss_mp.item() - loss_ref.item()) <= fwd_err + 2 * g_ref.norm().item() * bound, k
        lam = (g_at_mp - g_ref).norm().item() / dist if dist > 0 else 0.0
        assert lam * bound <= g_ref.norm().item(), "the first-order assumption failed: take smaller steps"
        bound = (1 + lr * lam) * bound + lr * tol_bwd * g_at_mp.norm().item()

        assert not mp.step(), f"step {k} overflowed at scale {mp.loss_scale}"
        mp.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    # The tolerance must be tighter than what it guards: the reference learned, and its weights
    # moved farther than the bound lets the two runs be apart (weights that never move fail).
    moved = (torch.cat([p.detach().flatten() for p in ref.parameters()]) - start).norm().item()
    assert loss_ref.item() < first_loss - 0.1 and bound < 0.5 * moved, (first_loss, loss_ref.item(), bound, moved)


# ---------------------------------------------------------------------------------------------
# Skipped steps, bytes, resuming, bad input
# ---------------------------------------------------------------------------------------------

def _tiny_gpt_fp16(scaler, seed=0):
    model = GPT(GPTConfig.preset("tiny"), seed=seed)
    mp = MixedPrecisionOptimizer(model.parameters(), lambda g: torch.optim.AdamW(g, lr=1e-3), dtype=torch.float16,
                                 loss_scaler=scaler)
    return model, mp


def test_mixed_precision_overflow_skips_the_step_and_touches_nothing():
    model, mp = _tiny_gpt_fp16(DynamicLossScaler(initial_scale_power=10, hysteresis=2))
    x, y = synthetic_token_batches(num_batches=1, batch_size=2, seq_len=16, seed=0)[0]
    mp.backward(model(x, y))
    assert not mp.step()  # one real step, so that AdamW has state to protect
    mp.zero_grad()
    before = mp.state_dict()
    params = [p.detach().clone() for p in model.parameters()]
    for expected_scale in (2.0**10, 2.0**9):  # hysteresis 2: the first overflow keeps the scale
        mp.backward(model(x, y))
        model.head.weight.grad[3, 1] = float("inf")
        assert mp.step(), "an inf gradient must skip the step"
        mp.zero_grad()
        assert mp.loss_scale == expected_scale
    after = mp.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(before["masters"], after["masters"]))
    for key, state in before["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, after["optimizer"]["state"][key][name]), name


def test_mixed_precision_static_scale_skips_overflow_too():
    model, mp = _tiny_gpt_fp16(StaticLossScaler(256.0))
    x, y = synthetic_token_batches(num_batches=1, batch_size=2, seq_len=16, seed=0)[0]
    mp.backward(model(x, y))
    model.embed.weight.grad[0, 0] = float("nan")
    masters = [m.clone() for m in mp.masters]
    assert mp.step() and mp.loss_scale == 256.0
    assert all(torch.equal(a, b) for a, b in zip(masters, mp.masters))


@pytest.mark.parametrize("dtype", LOW)
def test_mixed_precision_model_states_cost_16_bytes_per_parameter_like_fp32_adam(dtype):
    """ZeRO's accounting (sec. 3.1): fp16/bf16 parameter and gradient 2 + 2, fp32 master and Adam's
    two moments 4 + 8: 16 bytes per parameter, exactly what fp32 Adam needs (4 + 4 + 8)."""
    model = GPT(GPTConfig.preset("tiny"), seed=0)
    psi = sum(p.numel() for p in model.parameters())
    mp = MixedPrecisionOptimizer(model.parameters(), lambda g: torch.optim.AdamW(g, lr=1e-3), dtype=dtype)
    x, y = synthetic_token_batches(num_batches=1, batch_size=2, seq_len=16, seed=0)[0]
    mp.backward(model(x, y))
    mp.step()  # AdamW creates its moments in the first step; the gradients are still there
    got = mp.model_state_bytes()
    assert got == {"params": 2 * psi, "grads": 2 * psi, "master": 4 * psi, "optimizer_states": 8 * psi}

    fp32 = GPT(GPTConfig.preset("tiny"), seed=0)
    opt = torch.optim.AdamW(fp32.parameters(), lr=1e-3)
    fp32(x, y).backward()
    opt.step()
    states = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim() > 0)
    fp32_bytes = sum(p.numel() * 4 + p.grad.numel() * 4 for p in fp32.parameters()) + states
    assert sum(got.values()) == fp32_bytes == 16 * psi


def test_mixed_precision_resume_from_state_dict_is_bit_exact():
    batches = synthetic_token_batches(num_batches=5, batch_size=2, seq_len=16, seed=4)

    def train(model, mp, part):
        for x, y in part:
            mp.backward(model(x, y))
            mp.step(max_norm=1.0)
            mp.zero_grad()

    model, mp = _tiny_gpt_fp16(DynamicLossScaler(loss_scale_window=2))
    train(model, mp, batches[:3])
    saved = mp.state_dict()
    train(model, mp, batches[3:])

    # A fresh model whose fp16 weights are *not* the trained ones: everything must come from
    # the state (the masters' low bits above all: rounding the fp16 weights up would not do).
    resumed, mp2 = _tiny_gpt_fp16(DynamicLossScaler(loss_scale_window=2), seed=1)
    mp2.load_state_dict(saved)
    assert mp2.loss_scaler.state_dict() == saved["loss_scaler"]
    train(resumed, mp2, batches[3:])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(mp.masters, mp2.masters))


def test_mixed_precision_optimizer_bad_input_is_named():
    make = sgd(0.1)
    with pytest.raises(ValueError, match="dtype=torch.int8"):
        MixedPrecisionOptimizer([torch.nn.Parameter(torch.ones(2))], make, dtype=torch.int8)
    with pytest.raises(ValueError, match="no parameter requires grad"):
        MixedPrecisionOptimizer([torch.nn.Parameter(torch.ones(2), requires_grad=False)], make, dtype=torch.float16)
    mp = MixedPrecisionOptimizer([torch.nn.Parameter(torch.ones(2))], make, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="max_norm=-1"):
        mp.step(max_norm=-1)
    other = MixedPrecisionOptimizer([torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))], make,
                                    dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="different model"):
        mp.load_state_dict(other.state_dict())


def test_mixed_precision_casts_frozen_and_tied_parameters_once():
    model = TinyMLP(seed=0, dtype=torch.float32)  # a frozen layer and a tied weight
    mp = MixedPrecisionOptimizer(model.parameters(), sgd(0.1), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert len(mp.masters) == sum(1 for p in model.parameters() if p.requires_grad)
    x, y = synthetic_regression_batches(num_batches=1, batch_size=4, dim=8, seed=0, dtype=torch.bfloat16)[0]
    mp.backward(model(x, y))
    frozen = model.frozen.weight.detach().clone()
    assert not mp.step()
    assert torch.equal(model.frozen.weight, frozen)
