"""The kernels compiled on a GPU, in float32, bfloat16 and float16 (issue 15). Run: `pytest -k kernels_gpu`.

These need CUDA and skip without it (the CPU machine runs the interpreter's float32 tests in
test_kernels.py). TINYSCALE_KERNEL_TEST_DEVICE=cpu runs them on the CPU instead, which
checks this file's arithmetic: there bf16/fp16 inputs take the PyTorch references (the
interpreter's reduced-precision paths are not trusted) and float32 takes the interpreter.

Tolerances come from the format. The truth is float64 math on the same (rounded) inputs.
The baseline is PyTorch eager in the same dtype, rounding at the same places as the kernel
(scores and probabilities stored in the format, matmuls accumulated in float32). A kernel
may be off from the truth by at most

    2 x (the baseline's error) + 4 u max|truth|,      u = the format's unit roundoff (eps / 2)

Twice the baseline: the kernel rounds as often as eager PyTorch, but in another order.
4 u max|truth|: output rounding (one u) plus the GPU's approximate exp, rsqrt and division
(a few float32 ulps), which matter only in float32, where the baseline error is tiny.
A missing rescale, a wrong mask or a dropped block is off by 1e-2 of max|truth| or more,
far above every bound here (float16: 4 u = 2e-3; bfloat16: 1.6e-2 only together with a
baseline error that is itself that large).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tinyscale.kernels import (HAS_TRITON, attention_reference, dequantize_int8, flash_attention, fused_adamw_,
                               fused_linear_cross_entropy, quantize_int8, quantize_reference, rms_norm,
                               rms_norm_reference)
from tinyscale.kernels.fused_norm import counter_site, fused_dropout_residual_layer_norm, fused_norm_reference
from tinyscale.kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference
from tinyscale.models.dropout import SITE_MLP, DropoutClock, residual_dropout

DEVICE = os.environ.get("TINYSCALE_KERNEL_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install -e .[triton])"),
    pytest.mark.skipif(DEVICE is None, reason="compiled kernels need a CUDA GPU (TINYSCALE_KERNEL_TEST_DEVICE=cpu "
                                              "runs this file's checks on the CPU)"),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _u(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


# A code is round(x / scale), |x / scale| <= 127, so the float32 quotient is off by up to 127
# ulps-of-1 (127 x 2^-24), which moves a value near k + 1/2 to the other code; dequantizing
# (code x scale) rounds once more at that size, the difference once at half a step.
_ROUNDING = (2 * 127 + 1) * 2.0**-24


def _randn(*shape, dtype, seed, grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)
    return t.requires_grad_(grad)


def _assert_within(got, truth, baseline, dtype, what):
    """|got - truth| <= 2 |baseline - truth|_max + 4 u max|truth| (see the module's docstring)."""
    got, truth, baseline = got.double(), truth.double(), baseline.double()
    err = (got - truth).abs().max().item()
    allowed = 2 * (baseline - truth).abs().max().item() + 4 * _u(dtype) * truth.abs().max().item()
    assert err <= allowed, f"{what} ({dtype}): error {err:.3g} > allowed {allowed:.3g}"


def _eager_attention(q, k, v, causal):
    """Attention in q's dtype as eager PyTorch writes it: scores and probabilities stored in
    the format (softmax computed in float32), matmuls accumulated in float32 by the GPU."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        T = q.shape[2]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("causal", "H", "K", "T", "D"), [(True, 4, 2, 100, 64), (False, 4, 4, 128, 32),
                                                          (True, 6, 1, 77, 16), (True, 4, 2, 200, 128)],
                         ids=["causal-gqa-T100-D64", "full-mha-T128-D32", "causal-mqa-T77-D16",
                              "causal-gqa-T200-D128"])  # D128: the tiles the H100 sweep chose (half: 64 rows, 2 stages)
def test_kernels_gpu_flash_attention_output_lse_and_gradients(dtype, causal, H, K, T, D):
    q, k, v = (_randn(2, h, T, D, dtype=dtype, seed=s, grad=True) for h, s in ((H, 1), (K, 2), (K, 3)))
    dout = _randn(2, H, T, D, dtype=dtype, seed=4)
    out, lse = flash_attention(q, k, v, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    kind = "causal" if causal else "full"
    out64, lse64 = attention_reference(q64, k64, v64, causal_mask_kind=kind, scale=D**-0.5)
    grads64 = torch.autograd.grad(out64, (q64, k64, v64), dout.double())

    qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
    outb = _eager_attention(qb, kb, vb, causal)
    gradsb = torch.autograd.grad(outb, (qb, kb, vb), dout)

    _assert_within(out, out64, outb, dtype, "out")
    # lse is float32 in the kernel for every input dtype: float32's rounding of the scores
    # (D products) and of the log, against values of size max|s| + log T
    lse_atol = 64 * _u(torch.float32) * (lse64.abs().max().item() + 1)
    torch.testing.assert_close(lse.double(), lse64, rtol=0, atol=lse_atol)
    for name, got, truth, base in zip("qkv", grads, grads64, gradsb):
        _assert_within(got, truth, base, dtype, f"d{name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernels_gpu_rmsnorm_forward_and_backward(dtype):
    x, w = _randn(64, 1000, dtype=dtype, seed=1, grad=True), _randn(1000, dtype=dtype, seed=2, grad=True)
    dy = _randn(64, 1000, dtype=dtype, seed=3)
    y = rms_norm(x, w, 1e-6)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = rms_norm_reference(x64, w64, 1e-6)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    xb, wb = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yb = rms_norm_reference(xb, wb, 1e-6)  # float32 inside, rounded to the format: as the kernel
    dxb, dwb = torch.autograd.grad(yb, (xb, wb), dy)
    _assert_within(y, y64, yb, dtype, "y")
    _assert_within(dx, dx64, dxb, dtype, "dx")
    _assert_within(dw, dw64, dwb, dtype, "dw")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernels_gpu_fused_cross_entropy(dtype):
    N, C, V = 256, 64, 5000
    h, w = _randn(N, C, dtype=dtype, seed=1, grad=True), _randn(V, C, dtype=dtype, seed=2, grad=True)
    targets = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    targets[::7] = -100
    loss = fused_linear_cross_entropy(h, w, targets, chunk=64)
    dh, dw = torch.autograd.grad(loss, (h, w))
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    loss64 = F.cross_entropy(h64 @ w64.T, targets, ignore_index=-100)
    dh64, dw64 = torch.autograd.grad(loss64, (h64, w64))
    hb, wb = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    lossb = F.cross_entropy(hb @ wb.T, targets, ignore_index=-100)  # logits in the format
    dhb, dwb = torch.autograd.grad(lossb, (hb, wb))
    _assert_within(loss, loss64, lossb, dtype, "loss")
    _assert_within(dh, dh64, dhb, dtype, "dh")
    _assert_within(dw, dw64, dwb, dtype, "dw")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernels_gpu_quantize_equals_the_reference_exactly(dtype):
    n, block = 100_000, 256
    x = _randn(n, dtype=dtype, seed=5) * 4
    x[:block] = 0  # a block of zeros: scale 0, codes 0
    codes, scales = quantize_int8(x, block)
    ref_codes, ref_scales = quantize_reference(x, block)
    # exact: the kernel divides with IEEE rounding (div_rn), as PyTorch does tensor by tensor
    assert torch.equal(scales, ref_scales), f"{(scales != ref_scales).sum().item()} of {scales.numel()} scales differ"
    assert torch.equal(codes, ref_codes), f"{(codes != ref_codes).sum().item()} of {n} codes differ"
    back = dequantize_int8(codes, scales, block)
    step = scales.repeat_interleave(block)[:n]
    assert ((back - x.float()).abs() <= step / 2 + _ROUNDING * step).all()


@pytest.mark.parametrize("foreach", [False, True])
def test_kernels_gpu_adamw_equals_torch_adamw(foreach):
    # float32 only: the optimizer's buffers are ZeRO's float32 master shards
    n = 1_000_003  # not a multiple of the block
    p = _randn(n, dtype=torch.float32, seed=1)
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, foreach=foreach)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step in range(1, 4):
        g = _randn(n, dtype=torch.float32, seed=10 + step)
        ref.grad = g.clone()
        opt.step()
        fused_adamw_(p, g, m, v, lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, step=step)
        # float32, the same arithmetic fused (the GPU's sqrt and division within a few ulps): as on the CPU
        torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernels_gpu_grouped_gemm_forward_and_backward(dtype):
    """MoE's grouped GEMM compiled: groups of 0, 1 and uneven rows (not multiples of the tile),
    against the loop of matmuls in float64 (truth) and in the format (baseline)."""
    counts, K, N = [37, 0, 130, 1, 64], 96, 80
    x = _randn(sum(counts), K, dtype=dtype, seed=1, grad=True)
    w = _randn(len(counts), K, N, dtype=dtype, seed=2, grad=True)
    dy = _randn(sum(counts), N, dtype=dtype, seed=3)
    y = grouped_gemm(x, w, counts)
    assert "GroupedGemm" in type(y.grad_fn).__name__, "the kernel ran, not the loop"
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = grouped_gemm_reference(x64, w64, counts)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    xb, wb = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yb = grouped_gemm_reference(xb, wb, counts)  # eager matmuls in the format, float32 accumulation
    dxb, dwb = torch.autograd.grad(yb, (xb, wb), dy)
    _assert_within(y, y64, yb, dtype, "y")
    _assert_within(dx, dx64, dxb, dtype, "dx")
    _assert_within(dw, dw64, dwb, dtype, "dw")


def _on_device(fn, dtype):
    """fn run on DEVICE in `dtype`, its outputs back on the CPU in float32 (the CPU checks' harness)."""
    def run(*args, **kwargs):
        move = lambda t: t.to(DEVICE, dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
        outs = fn(*map(move, args), **{k: move(v) for k, v in kwargs.items()})
        return tuple(t.float().cpu() for t in outs)
    return run


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("B", "T", "C"), [(4, 50, 1000), (2, 33, 5000)], ids=["C1000", "C5000"])
def test_kernels_gpu_fused_norm_forward_backward_and_the_models_mask(dtype, B, T, C):
    """DS-32 compiled: dropout (counter mask) + residual + LayerNorm at widths that are not powers of
    two, y, h and all five gradients against float64 (truth) and eager in the format (baseline),
    and the mask bit-equal to the model's `residual_dropout` at the same clock."""
    p, clock = 0.1, DropoutClock(seed=3, step=7, row0=12)
    key, rows, positions = counter_site(clock, 2, SITE_MLP, B, T, DEVICE)
    ones = torch.ones(B, T, C, device=DEVICE, dtype=dtype)
    _, h_mask = fused_dropout_residual_layer_norm(ones, torch.zeros_like(ones), ones[0, 0], ones[0, 0] * 0, p=p,
                                                  key=key, rows=rows, positions=positions)
    model = residual_dropout(torch.ones(B, T, C, device=DEVICE), p, clock, 2, SITE_MLP)
    assert torch.equal(h_mask != 0, model != 0), f"{((h_mask != 0) != (model != 0)).sum().item()} mask elements differ"

    args = [_randn(B, T, C, dtype=dtype, seed=1, grad=True), _randn(B, T, C, dtype=dtype, seed=2, grad=True)] + \
        [_randn(C, dtype=dtype, seed=s, grad=True) for s in (3, 4, 5)]  # x, residual, weight, ln_bias, bias
    dy, dh = _randn(B, T, C, dtype=dtype, seed=6), _randn(B, T, C, dtype=dtype, seed=7)
    y, h = fused_dropout_residual_layer_norm(*args[:4], p=p, key=key, rows=rows, positions=positions, bias=args[4])
    if DEVICE != "cpu" or dtype == torch.float32:  # on the CPU, bf16/fp16 take the reference (module docstring)
        assert "FusedNorm" in type(y.grad_fn).__name__, "the reference ran, not the kernel"
    grads = torch.autograd.grad((y, h), args, (dy, dh))
    a64 = [a.detach().double().requires_grad_() for a in args]
    y64, h64 = fused_norm_reference(*a64[:4], p, key, rows, positions, a64[4])
    g64 = torch.autograd.grad((y64, h64), a64, (dy.double(), dh.double()))
    ab = [a.detach().clone().requires_grad_() for a in args]
    yb, hb = fused_norm_reference(*ab[:4], p, key, rows, positions, ab[4])  # eager in the format
    gb = torch.autograd.grad((yb, hb), ab, (dy, dh))
    _assert_within(y, y64, yb, dtype, "y")
    _assert_within(h, h64, hb, dtype, "h")
    for name, got, truth, base in zip(("dx", "dresidual", "dweight", "dln_bias", "dbias"), grads, g64, gb):
        _assert_within(got, truth, base, dtype, name)


def test_kernels_gpu_fused_norm_keep_rate_and_independent_draws_on_4m_elements():
    """The CPU's statistical checks (tests/kernels/test_fused_norm.py) on the compiled kernel, 4M
    elements: the 5-sigma bound on the keep rate is then 7e-4. Float32: in bf16 the stored
    1/(1-p) is itself rounded (1/0.9 -> 1.109375, 0.16% low), which the mean check would see."""
    from tests.kernels.test_fused_norm import check_keep_rate, check_row_independence

    fn = _on_device(fused_dropout_residual_layer_norm, torch.float32)
    for p in (0.1, 0.3):
        check_keep_rate(fn, p, B=16, T=256, C=1000)
    check_row_independence(fn, 0.3, B=16, T=256, C=1000)
