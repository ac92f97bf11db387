"""The fused dropout + residual + LayerNorm kernel (DS-32), float32 under Triton's CPU interpreter.
Run: `pytest -k fused_norm` (GPU, three formats: `-k kernels_gpu_fused_norm`).

Each of the erratum's three CUDA bugs is a check here, written as a function of the
implementation so that the last test can run it on a planted copy of the bug and see it fail:

1. keep probability inverted (kept when u < p): `check_keep_rate`, the keep rate is 1-p and
   the output's mean is the input's, within a binomial bound;
2. a reduction that is only right for power-of-two widths (the tree over blockDim, and the
   read-then-overwrite race of the mean): `check_widths`, widths 77 and 100 (not powers of two,
   not multiples of the 128-lane block) against float64;
3. every thread of a row drawing the same random number: `check_row_independence`, no row kept
   or dropped whole, and neighbours agree as often as independent draws do;

plus `check_residual_added` (the erratum's "residual" was the LayerNorm's input, not a sum).
Statistical bounds: the counter hash is deterministic, so each check passes or fails the same
way every run; the 5-sigma bounds say how far an ideal uniform draw would stray (a 5-sigma
excursion has probability 6e-7).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tinyscale.kernels import HAS_TRITON
from tinyscale.kernels.fused_norm import counter_site, fused_dropout_residual_layer_norm, fused_norm_reference
from tinyscale.models.dropout import SITE_ATTN, SITE_MLP, DropoutClock, keep_mask, residual_dropout

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install -e .[triton])")
U32 = 2.0**-24  # float32's unit roundoff
KEY = 0x5EED  # any site key


def _randn(*shape, seed, grad=False, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype) \
        .requires_grad_(grad)


_MASKS: dict = {}  # the interpreter is slow: the keep-rate and independence checks share their p = 0.3 run


def _kept(fn, p, B, T, C, key=KEY, rows=None, positions=None):
    """The implementation's keep-mask (B, T, C): x = 1, residual = 0 makes h = 1/(1-p) where kept, 0 where dropped."""
    if rows is None and positions is None:
        cache = (fn, p, B, T, C, key)
        if cache not in _MASKS:
            _MASKS[cache] = _kept(fn, p, B, T, C, key, torch.arange(B), torch.arange(T))
        return _MASKS[cache]
    ones = torch.ones(B, T, C)
    _, h = fn(ones, torch.zeros(B, T, C), torch.ones(C), torch.zeros(C), p=p, key=key, rows=rows, positions=positions)
    return h != 0, h


def assert_within(got, truth, baseline, what, u=U32):
    """|got - truth| <= 2 |baseline - truth|_max + 4 u max|truth|: the same arithmetic in another
    order rounds as often as the baseline (float32 eager), plus one rounding of the output and
    the kernel's division and square root (tests/kernels/test_kernels_gpu.py derives it)."""
    got, truth, baseline = got.double(), truth.double(), baseline.double()
    err = (got - truth).abs().max().item()
    allowed = 2 * (baseline - truth).abs().max().item() + 4 * u * truth.abs().max().item()
    assert err <= allowed, f"{what}: error {err:.3g} > allowed {allowed:.3g}"


def check_keep_rate(fn, p: float, B: int = 8, T: int = 25, C: int = 100):
    """Bug 1: kept with probability 1-p, kept values scaled by 1/(1-p), so E[h] = x."""
    keep, h = _kept(fn, p, B, T, C)
    n = keep.numel()
    sigma = math.sqrt(p * (1 - p) / n)  # binomial: the keep fraction's standard deviation
    rate = keep.double().mean().item()
    assert abs(rate - (1 - p)) <= 5 * sigma, f"keep rate {rate:.4f}, expected {1 - p} +- {5 * sigma:.4f}"
    # E[h] = 1 for x = 1; mean(h) = rate / (1 - p): its deviation is the rate's over (1 - p)
    mean = h.double().mean().item()
    assert abs(mean - 1) <= 5 * sigma / (1 - p), f"mean of dropout(1) is {mean:.4f}, expected 1"
    assert torch.equal(h[keep], torch.full_like(h[keep], 1 / (1 - p)))  # the scale, in float32


def check_row_independence(fn, p: float = 0.3, B: int = 8, T: int = 25, C: int = 100):
    """Bug 3: every element its own draw. C = 100 fits one 128-lane block, so a per-row (or
    per-program) draw would keep or drop a row whole."""
    keep, _ = _kept(fn, p, B, T, C)
    rows = keep.reshape(B * T, C)
    # an ideal draw keeps all 100 of a row with probability 0.7^100 = 3e-16, drops all with 0.3^100
    assert not (rows.all(1) | ~rows.any(1)).any(), "a row was kept or dropped whole"
    q = p * p + (1 - p) * (1 - p)  # two independent draws agree (both kept or both dropped)
    for what, a, b in [("neighbouring features", rows[:, 1:], rows[:, :-1]),
                       ("features 64 apart", rows[:, 64:], rows[:, :-64]),
                       ("neighbouring tokens", keep[:, 1:], keep[:, :-1]),
                       ("neighbouring batch rows", keep[1:], keep[:-1])]:
        agree = (a == b).double().mean().item()
        bound = 5 * math.sqrt(q * (1 - q) / a.numel())
        assert abs(agree - q) <= bound, f"{what} agree {agree:.3f}, independent draws {q:.3f} +- {bound:.3f}"


def check_widths(fn, widths=(77, 100, 16), p: float = 0.2):
    """Bug 2: the row's mean and variance are right for any width, against float64; forward
    and backward, with bias, against the float32 eager reference as the baseline."""
    for C in widths:
        B, T = 2, 3
        args = [_randn(B, T, C, seed=C + i, grad=True) for i in range(2)] + \
            [_randn(C, seed=C + i, grad=True) for i in range(2, 5)]  # x, residual, weight, ln_bias, bias
        x, residual, weight, ln_bias, bias = args
        y, h = fn(x, residual, weight, ln_bias, p=p, key=KEY, bias=bias)
        dy, dh = _randn(B, T, C, seed=1), _randn(B, T, C, seed=2)
        grads = torch.autograd.grad((y, h), args, (dy, dh))
        rows, positions = torch.arange(B), torch.arange(T)
        a64 = [a.detach().double().requires_grad_() for a in args]
        y64, h64 = fused_norm_reference(*a64[:4], p, KEY, rows, positions, a64[4])
        g64 = torch.autograd.grad((y64, h64), a64, (dy.double(), dh.double()))
        a32 = [a.detach().clone().requires_grad_() for a in args]
        y32, h32 = fused_norm_reference(*a32[:4], p, KEY, rows, positions, a32[4])
        g32 = torch.autograd.grad((y32, h32), a32, (dy, dh))
        assert_within(y, y64, y32, f"y, C={C}")
        assert_within(h, h64, h32, f"h, C={C}")
        for name, got, truth, base in zip(("dx", "dresidual", "dweight", "dln_bias", "dbias"), grads, g64, g32):
            assert_within(got, truth, base, f"{name}, C={C}")


def check_residual_added(fn, B: int = 2, T: int = 3, C: int = 40):
    """h = residual + dropout(x): exactly the float32 sum (one rounding, the same as eager), and
    a dropped element leaves the residual as it was."""
    x, residual = _randn(B, T, C, seed=1), _randn(B, T, C, seed=2)
    weight, ln_bias = torch.ones(C), torch.zeros(C)
    y, h = fn(x, residual, weight, ln_bias, p=0.0, key=KEY)
    assert torch.equal(h, residual + x), "p = 0: h is not residual + x"
    torch.testing.assert_close(y, F.layer_norm(residual + x, (C,)), rtol=0, atol=64 * U32)  # O(1) values, C = 40 terms
    _, h = fn(x, residual, weight, ln_bias, p=0.5, key=KEY)
    keep = keep_mask(0.5, KEY, torch.arange(B)[:, None, None], torch.arange(T)[None, :, None],
                     torch.arange(C)[None, None, :])
    assert torch.equal(h, residual + x * (keep * 2.0)), "p = 0.5: h is not residual + dropout(x)"


def test_kernels_fused_norm_mask_equals_the_models_counter_dropout_mask_exactly():
    """The kernel's mask is the eager model's `residual_dropout` mask at the same clock, bit for bit:
    rows offset by row0, context-parallel token positions, another step, layer and site."""
    B, T, C, p = 3, 5, 77, 0.25
    for clock, layer, site, shard in [(DropoutClock(seed=7, step=3, row0=11), 2, SITE_ATTN, None),
                                      (DropoutClock(seed=1, step=0, row0=0, positions=torch.tensor([9, 2, 4, 7, 30])),
                                       0, SITE_MLP, None),
                                      (DropoutClock(seed=5, step=8, row0=4), 1, SITE_MLP, (1, 2))]:
        key, rows, positions = counter_site(clock, layer, site, B, T, "cpu", shard)
        keep, h = _kept(fused_dropout_residual_layer_norm, p, B, T, C, key, rows, positions)
        model = residual_dropout(torch.ones(B, T, C), p, clock, layer, site, shard)
        assert torch.equal(keep, model != 0), f"{(keep != (model != 0)).sum().item()} of {keep.numel()} differ"
        assert torch.equal(h, model)  # and the kept values: the same float32 scale


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_kernels_fused_norm_keeps_one_minus_p_and_preserves_the_mean(p):
    check_keep_rate(fused_dropout_residual_layer_norm, p)


def test_kernels_fused_norm_draws_each_element_of_a_row_independently():
    check_row_independence(fused_dropout_residual_layer_norm)


@pytest.mark.parametrize("backward", ["rows", "two_pass"])
def test_kernels_fused_norm_widths_not_powers_of_two_forward_and_backward_equal_float64(backward, monkeypatch):
    from tinyscale.kernels import fused_norm

    monkeypatch.setattr(fused_norm, "BACKWARD", backward)  # both backward kernels (lesson 11, on an H200)
    check_widths(fused_dropout_residual_layer_norm)


@pytest.mark.thorough
@pytest.mark.parametrize("p", [0.05, 0.5, 0.9])
def test_kernels_fused_norm_thorough_keep_rate_and_widths_around_the_block(p):
    """--thorough: more rates, and widths at and next to a power of two (1 lane; 127, 128, 129; 255)."""
    check_keep_rate(fused_dropout_residual_layer_norm, p)
    check_widths(fused_dropout_residual_layer_norm, widths=(1, 3, 127, 128, 129, 255), p=p)


def test_kernels_fused_norm_really_adds_the_residual():
    check_residual_added(fused_dropout_residual_layer_norm)


def test_kernels_fused_norm_refuses_p_outside_0_1_and_mismatched_shapes_by_name():
    x = torch.zeros(1, 2, 4)
    w = torch.ones(4)
    with pytest.raises(ValueError, match="p=1"):
        fused_dropout_residual_layer_norm(x, x, w, w, p=1)
    with pytest.raises(ValueError, match="residual"):
        fused_dropout_residual_layer_norm(x, torch.zeros(1, 2, 5), w, w, p=0.1)
    with pytest.raises(ValueError, match="bias"):
        fused_dropout_residual_layer_norm(x, x, w, w, p=0.1, bias=torch.zeros(3))


# Planted copies of the erratum's bugs, in torch: each check above must reject its bug.
def _planted(bug):
    def fn(x, residual, weight, ln_bias, *, p, key, rows=None, positions=None, bias=None, eps=1e-5):
        B, T, C = x.shape
        rows = torch.arange(B) if rows is None else rows
        positions = torch.arange(T) if positions is None else positions
        features = torch.zeros(C, dtype=torch.int64) if bug == "same draw per row" else torch.arange(C)
        keep = keep_mask(p, key, rows[:, None, None], positions[None, :, None], features[None, None, :])
        if bug == "keep when u < p":
            keep = ~keep
        z = (x if bias is None else x + bias) * (keep.to(x.dtype) / (1 - p))
        h = z if bug == "no residual" else residual + z
        if bug == "power-of-two reduction":  # the tree sums the first 2^k lanes only, then divides by C
            k = 2 ** int(math.log2(C))
            mean = h[..., :k].sum(-1, keepdim=True) / C
            var = ((h - mean)[..., :k] ** 2).sum(-1, keepdim=True) / C
            return (h - mean) * torch.rsqrt(var + eps) * weight + ln_bias, h
        return F.layer_norm(h, (C,), weight, ln_bias, eps), h
    return fn


@pytest.mark.parametrize(("bug", "check"), [("keep when u < p", lambda fn: check_keep_rate(fn, 0.1)),
                                            ("power-of-two reduction", check_widths),
                                            ("same draw per row", check_row_independence),
                                            ("no residual", check_residual_added)])
def test_kernels_fused_norm_checks_fail_on_the_planted_erratum_bugs(bug, check):
    check(_planted(None))  # the bug-free torch version passes the check...
    with pytest.raises(AssertionError):
        check(_planted(bug))  # ...and its planted bug does not


def test_kernels_fused_norm_eager_moves_three_and_a_half_times_the_kernels_bytes():
    """Lesson 11's count: eager `LayerNorm(residual + F.dropout(x))` traced on meta tensors (as the
    CPU dispatches it: F.dropout is empty_like, bernoulli_, div_, mul) against the kernel's loads
    and stores (x, residual in; y, h out; weight, bias; mean, rstd per row)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "notebooks"))
    import kernels_traffic as kt

    B, T, N = 8, 1024, 4096
    R, e = B * T, 2
    x, residual = (torch.empty(B, T, N, device="meta", dtype=torch.bfloat16) for _ in range(2))
    w, b = (torch.empty(N, device="meta", dtype=torch.bfloat16) for _ in range(2))
    eager = lambda: F.layer_norm(residual + F.dropout(x, 0.1, training=True), (N,), w, b)  # noqa: E731
    assert kt.eager_ops(eager) == ["empty_like", "bernoulli_", "div_", "mul", "add", "native_layer_norm"]
    _, eager_bytes = kt.eager_traffic(eager)
    fused = kt.fused_traffic("fused_norm", e=e, R=R, N=N)
    assert fused == 4 * R * N * e + 2 * N * e + 8 * R
    assert eager_bytes == 14 * R * N * e + 2 * N * e + 8 * R, eager_bytes / (R * N * e)
