"""Fused int8 quantize / dequantize with one scale per block of elements.

    scale_b = max |x| over block b / 127        q = round(x / scale_b) in [-127, 127]

One program per block: load it, reduce its max, scale, round, store the codes and the
scale — one read of x and a write of n bytes + n / block scales, where PyTorch's unfused
version makes abs, amax, div, round, clamp and cast passes. A block of zeros gets scale 0
and codes 0 (the division uses a clamped scale, so no NaN). Rounding is half away from
zero, written the same way in the kernel and the reference, so the codes agree exactly.
`tinyscale.compression.QSGD` is the stochastic, unbiased sibling; this is the deterministic
per-block quantizer ZeRO++ and 8-bit optimizers use.

Shape legend: n elements (flat), b = ceil(n / block) blocks.
Lesson: lessons/11-kernels.md. Tests: `pytest -k kernels_quantize`.
"""

import torch

from tinyscale.kernels._triton import jit, tl, triton, use_triton

# No `from __future__ import annotations`: Triton reads the kernels' `tl.constexpr` annotations.


def quantize_reference(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n,) -> (int8 codes (n,), float32 scales (b,)), the kernel's math written for reading."""
    n = x.numel()
    padded = torch.cat([x.float(), x.new_zeros(-n % block, dtype=torch.float32)]).view(-1, block)  # (b, block)
    amax = padded.abs().amax(dim=1)  # (b,)
    # Divided by a tensor, not by the number 127: on CUDA, PyTorch divides by a Python number
    # as a multiplication by its float32 reciprocal, 1 ulp off the quotient in a few % of blocks
    # (the first GPU run caught it); tensor by tensor it divides with IEEE rounding on every
    # device, as the kernel's div_rn does.
    scales = amax / amax.new_tensor(127.0)
    y = padded / scales.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    codes = (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-127, 127).to(torch.int8)
    return codes.view(-1)[:n], scales


def dequantize_reference(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    n = codes.numel()
    padded = torch.cat([codes, codes.new_zeros(-n % block)]).view(-1, block).float()  # (b, block)
    return (padded * scales[:, None]).view(-1)[:n]


# --8<-- [start:kernel]
@jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, n, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # div_rn: IEEE round-to-nearest division, as PyTorch's. A plain `/` compiles to the GPU's
    # approximate division (2 ulp), which moves a code by one where x / scale is near k + 1/2.
    scale = tl.math.div_rn(tl.max(tl.abs(x), axis=0), 127.0)
    y = tl.math.div_rn(x, tl.maximum(scale, 1.1754943508222875e-38))  # smallest normal: zeros stay zeros
    q = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(-y + 0.5))
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    tl.store(q_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(s_ptr + b, scale)
# --8<-- [end:kernel]


@jit
def _dequantize_kernel(q_ptr, s_ptr, y_ptr, n, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
    tl.store(y_ptr + offs, q * tl.load(s_ptr + b), mask=mask)


def _check(x: torch.Tensor, block: int) -> None:
    if x.dim() != 1:
        raise ValueError(f"quantize: expected a flat tensor, got shape {tuple(x.shape)}; pass x.view(-1)")
    if block < 1 or block & (block - 1):
        raise ValueError(f"quantize: block={block} must be a power of two (a Triton block)")


def quantize_int8(x: torch.Tensor, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n,) -> (int8 codes (n,), float32 scales (ceil(n / block),))."""
    _check(x, block)
    if not use_triton(x):
        return quantize_reference(x, block)
    n = x.numel()
    codes = torch.empty(n, dtype=torch.int8, device=x.device)
    scales = torch.empty(triton.cdiv(n, block), dtype=torch.float32, device=x.device)
    _quantize_kernel[(scales.numel(),)](x.contiguous(), codes, scales, n, BLOCK=block)
    return codes, scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, block: int = 256) -> torch.Tensor:
    """The inverse map: codes (n,) and scales (b,) -> float32 (n,)."""
    _check(codes, block)
    if not use_triton(codes):
        return dequantize_reference(codes, scales, block)
    out = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
    _dequantize_kernel[(scales.numel(),)](codes, scales, out, codes.numel(), BLOCK=block)
    return out
