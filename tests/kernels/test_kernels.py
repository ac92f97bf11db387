"""Triton kernels equal their PyTorch references and PyTorch's own ops (float32; on the CPU
under Triton's interpreter, which tests/conftest.py selects). Run: `pytest -k kernels`.

Tolerances: float32 kernels against float32 PyTorch differ only in summation order and
fused arithmetic, a few ulps of the values involved (~1e-7 relative); 1e-5 absolute on O(1)
quantities allows that with margin, while a wrong mask, a missing rescale or a dropped block
is off by 1e-2 or more.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from tinyscale.memory.trace import record_trace
from tinyscale.kernels import (
    HAS_TRITON, adamw_reference_, attention_reference, dequantize_int8, flash_attention, flash_block,
    fused_adamw_, fused_linear_cross_entropy, kernel_ok, quantize_int8, quantize_reference, rms_norm, rms_norm_reference,
)

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install -e .[triton])")
TOL = dict(rtol=1e-5, atol=1e-5)


# A code is round(x / scale), |x / scale| <= 127, so the float32 quotient is off by up to 127
# ulps-of-1 (127 x 2^-24), which moves a value near k + 1/2 to the other code; dequantizing
# (code x scale) rounds once more at that size, the difference once at half a step.
_ROUNDING = (2 * 127 + 1) * 2.0**-24


def _randn(*shape, seed=0, grad=False):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return t.requires_grad_(grad)


def test_kernels_run_as_triton_here_and_float64_stays_pytorch():
    assert kernel_ok(torch.zeros(2))  # the CPU under TRITON_INTERPRET=1, or a GPU
    assert not kernel_ok(torch.zeros(2, dtype=torch.float64))


@settings(max_examples=4)
@given(rows=st.integers(1, 6), n=st.sampled_from([5, 16, 24, 33]), seed=st.integers(0, 100))
def test_kernels_rmsnorm_forward_and_backward_equal_the_reference(rows, n, seed):
    x, w = _randn(2, rows, n, seed=seed, grad=True), _randn(n, seed=seed + 1, grad=True)
    y, ref = rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)
    torch.testing.assert_close(y, ref, **TOL)
    dy = _randn(*y.shape, seed=seed + 2)
    for a, b in zip(torch.autograd.grad(y, (x, w), dy), torch.autograd.grad(ref, (x, w), dy)):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("foreach", [False, True])
def test_kernels_adamw_equals_torch_adamw_step_for_step(foreach):
    p = _randn(1000, seed=1)
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, foreach=foreach)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step in range(1, 4):
        g = _randn(1000, seed=10 + step)
        ref.grad = g.clone()
        opt.step()
        fused_adamw_(p, g, m, v, lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, step=step, block=256)
        # float32: the same arithmetic fused; a few ulps of |p| ~ 1 after 3 steps
        torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-6)
        # exp_avg ~ 0.1-1 x |g|: the same lerp in float32, so a few ulps; 1e-7 absolute covers the smallest
        torch.testing.assert_close(m, opt.state[ref]["exp_avg"], rtol=1e-6, atol=1e-7)
    p2, m2, v2 = p.clone(), m.clone(), v.clone()
    adamw_reference_(p2, g, m2, v2, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=4)
    fused_adamw_(p, g, m, v, lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, step=4, block=256)
    torch.testing.assert_close(p, p2, rtol=1e-6, atol=1e-6)  # the reference's arithmetic in float32: ulps


def test_kernels_adamw_refuses_mismatched_buffers_by_name():
    p = torch.zeros(8)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        fused_adamw_(p, torch.zeros(8), torch.zeros(8), torch.zeros(7), lr=1e-3, step=1)
    with pytest.raises(ValueError, match="step=0"):
        fused_adamw_(p, torch.zeros(8), torch.zeros(8), torch.zeros(8), lr=1e-3, step=0)


@pytest.mark.parametrize(("n", "block"), [(1000, 128), (37, 16)])
def test_kernels_quantize_equals_the_reference_exactly_and_round_trips_within_half_a_step(n, block):
    x = _randn(n, seed=3) * 4
    x[:block] = 0  # a block of zeros: scale 0, codes 0, no NaN
    codes, scales = quantize_int8(x, block)
    ref_codes, ref_scales = quantize_reference(x, block)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    assert scales[0] == 0 and not torch.isnan(dequantize_int8(codes, scales, block)).any()
    back = dequantize_int8(codes, scales, block)
    step = scales.repeat_interleave(block)[:n]
    assert ((back - x).abs() <= step / 2 + _ROUNDING * step).all()
    assert codes.element_size() == 1 and scales.numel() == math.ceil(n / block)


def _sdpa(q, k, v, causal):
    G = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), is_causal=causal)


@pytest.mark.parametrize(("causal", "H", "K", "T"), [(True, 4, 2, 21), (False, 2, 2, 16)],
                         ids=["causal-gqa-T21", "full-mha-T16"])
def test_kernels_flash_attention_equals_sdpa_with_lse_and_gradients(causal, H, K, T):
    q, k, v = _randn(1, H, T, 8, seed=1, grad=True), _randn(1, K, T, 8, seed=2, grad=True), \
        _randn(1, K, T, 8, seed=3, grad=True)
    out, lse = flash_attention(q, k, v, causal=causal)
    ref = _sdpa(q, k, v, causal)
    torch.testing.assert_close(out, ref, **TOL)
    ref_out, ref_lse = attention_reference(q, k, v, causal_mask_kind="causal" if causal else "full", scale=8**-0.5)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    dout = _randn(*out.shape, seed=4)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, b, **TOL)


def test_kernels_flash_block_masks_padded_keys_and_gives_empty_rows_zero_and_minus_inf():
    q, k, v = _randn(1, 2, 16, 8, seed=5), _randn(1, 1, 16, 8, seed=6), _randn(1, 1, 16, 8, seed=7)
    valid = torch.arange(16) >= 3  # keys 0-2 are padding: causal rows 0-2 see nothing
    out, lse = flash_block(q, k, v, causal_mask_kind="causal", scale=0.3, key_valid=valid)
    ref_out, ref_lse = attention_reference(q, k, v, causal_mask_kind="causal", scale=0.3, key_valid=valid)
    assert torch.isneginf(lse[..., :3]).all() and torch.equal(out[..., :3, :], torch.zeros_like(out[..., :3, :]))
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse[..., 3:], ref_lse[..., 3:], **TOL)


def _peak_bytes(step) -> int:
    """Peak bytes of the storages `step` creates and holds at once (tinyscale.memory's trace)."""
    live = peak = 0
    sizes = {}
    for event in record_trace(step):
        if event[0] == "alloc":
            sizes[event[1]] = event[2]
            live += event[2]
            peak = max(peak, live)
        else:
            live -= sizes.pop(event[1])
    return peak


def test_kernels_cross_entropy_equals_unfused_and_holds_one_chunk_of_logits():
    N, C, V, chunk = 64, 16, 500, 8
    h, w = _randn(N, C, seed=1, grad=True), _randn(V, C, seed=2, grad=True)
    targets = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(3))
    targets[::7] = -100  # ignored rows: no loss, no gradient, not counted
    loss = fused_linear_cross_entropy(h, w, targets, chunk=chunk)
    ref = F.cross_entropy(h @ w.T, targets, ignore_index=-100)
    torch.testing.assert_close(loss, ref, **TOL)
    for a, b in zip(torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref, (h, w))):
        torch.testing.assert_close(a, b, **TOL)
    with torch.no_grad():
        fused = _peak_bytes(lambda: fused_linear_cross_entropy(h, w, targets, chunk=chunk))
        unfused = _peak_bytes(lambda: F.cross_entropy(h @ w.T, targets, ignore_index=-100))
    # unfused holds the (N, V) logits and the softmax's (N, V) output: >= 2 N V 4 bytes; fused holds
    # a (chunk, V) block plus dh (N, C) and dW (V, C): at N / chunk = 8 it must stay below half of it.
    assert unfused >= 2 * N * V * 4 and fused < unfused / 2, (fused, unfused)


def _zero_body(stage: int, fused: bool):
    import tinyscale as ts
    from tinyscale.data import synthetic_token_batches
    from tinyscale.kernels import FusedAdamW
    from tinyscale.models import GPT, GPTConfig

    config = {"train_batch_size": 4, "zero_optimization": {"stage": stage}}
    factory = (lambda groups: FusedAdamW(groups, lr=1e-2, weight_decay=0.1)) if fused else \
        (lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, foreach=False))
    engine = ts.initialize(GPT(GPTConfig.preset("tiny"), seed=0), config, optimizer=factory)
    losses = [engine.train_batch(b) for b in synthetic_token_batches(num_batches=3, batch_size=4, seq_len=8, seed=0)]
    return losses, engine.full_state_dict()


@pytest.mark.parametrize("stage", [2])
def test_kernels_adamw_in_zero_equals_zero_with_torch_adamw(stage):
    from tinyscale.testing import run_on_ranks
    fused = run_on_ranks(_zero_body, 2, stage, True)[0]
    plain = run_on_ranks(_zero_body, 2, stage, False)[0]
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-5)  # float32 losses, 3 steps
    for name, value in plain[1].items():
        # float32: the fused and torch's arithmetic differ by ulps per step (see the AdamW test)
        torch.testing.assert_close(fused[1][name], value, rtol=1e-5, atol=1e-5, msg=name)


@given(K=st.sampled_from([1, 2]), G=st.sampled_from([1, 3]), T=st.integers(1, 33), D=st.sampled_from([4, 16]),
       causal=st.booleans(), seed=st.integers(0, 1000))
def test_kernels_flash_attention_property_over_shapes(K, G, T, D, causal, seed):
    """Heads, GQA groups, head dims and lengths that are not multiples of the 16-wide tile."""
    q, k, v = _randn(1, K * G, T, D, seed=seed, grad=True), _randn(1, K, T, D, seed=seed + 1, grad=True), \
        _randn(1, K, T, D, seed=seed + 2, grad=True)
    out, lse = flash_attention(q, k, v, causal=causal)
    ref = _sdpa(q, k, v, causal)
    torch.testing.assert_close(out, ref, **TOL)
    dout = _randn(*out.shape, seed=seed + 3)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, b, **TOL)
