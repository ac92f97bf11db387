"""Fused RMSNorm: one kernel reads x once and writes y, instead of PyTorch's five passes.

    y = x / sqrt(mean(x^2) + eps) * w            (per row of length N)

Unfused, PyTorch runs pow, mean, add+rsqrt, mul, mul: each reads and writes a (rows, N)
tensor, ~5 x 2 passes over memory; fused, one program per row loads the row into registers,
reduces it, and writes y (2 passes: read x, write y). Backward, with x_hat = x * rstd and
g = dy * w:

    dx = rstd * (g - x_hat * mean(g * x_hat))     dw = sum over rows of dy * x_hat

The forward saves rstd (one number per row), so the backward recomputes x_hat instead of
storing it. dw's sum over rows is written as per-row partials and summed by torch (no
atomics: the result is deterministic). Compute in float32 at least, as the GPT's RMSNorm.

Shape legend: R rows (every dim but the last, flattened), N the normalised dim.
Lesson: lessons/11-kernels.md. Tests: `pytest -k kernels_rmsnorm`.
"""

# No `from __future__ import annotations`: Triton reads the kernels' `tl.constexpr` annotations.

import torch

from tinyscale.kernels._triton import jit, tl, triton, use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same math as tinyscale.models.gpt.RMSNorm, for reading and as the fallback."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


# --8<-- [start:forward]
@jit
def _rms_forward(x_ptr, w_ptr, y_ptr, rstd_ptr, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)  # (BLOCK,) one row
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)
# --8<-- [end:forward]


@jit
def _rms_backward(x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_part_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    x_hat = x * rstd  # recomputed, not stored
    g = dy * w
    dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / N))
    tl.store(dx_ptr + row * N + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_part_ptr + row * N + cols, dy * x_hat, mask=mask)  # this row's share of dw


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()  # (R, N)
        R, N = x2.shape
        y = torch.empty_like(x2)
        rstd = torch.empty(R, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(N)
        _rms_forward[(R,)](x2, weight.contiguous(), y, rstd, N, eps, BLOCK=block)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        R, N = x2.shape
        dx = torch.empty_like(x2)
        dw_part = torch.empty(R, N, dtype=torch.float32, device=x2.device)  # (R, N) per-row partials
        block = triton.next_power_of_2(N)
        _rms_backward[(R,)](x2, weight.contiguous(), dy.reshape(R, N).contiguous(), rstd, dx, dw_part, N, BLOCK=block)
        return dx.view(ctx.shape), dw_part.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim: the Triton kernel where it can run, else the reference."""
    if x.shape[-1] != weight.numel():
        raise ValueError(f"rms_norm: x's last dim is {x.shape[-1]} but weight has {weight.numel()} elements")
    if use_triton(x) and x.dtype != torch.float64:  # Triton's float64 path is not what we test
        return _RMSNorm.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
