"""What fp16 and bf16 can hold: their limits, and what a cast does to a tensor of real values.

Paper: Micikevicius et al., "Mixed Precision Training" (ICLR 2018), sec. 3.2, fig. 3 (the
histogram of activation gradients, most of them below fp16's range). Lesson:
lessons/04-mixed-precision.md, which runs `cast_report` on the tiny GPT's real gradients
(notebooks/04-mixed-precision.ipynb, section 2). Tests: ``pytest -k mixed_precision``.

    format   exponent/mantissa bits   smallest subnormal   smallest normal   largest    spacing at 1
    fp32     8 / 23                   1.4e-45              1.2e-38           3.4e38     2^-23
    bf16     8 / 7                    9.2e-41              1.2e-38           3.4e38     2^-7
    fp16     5 / 10                   6.0e-8  (2^-24)      6.1e-5 (2^-14)    65504      2^-10

bf16 keeps fp32's range with 3 decimal digits less; fp16 keeps 3 more bits than bf16 and
loses range at both ends. A value below half the smallest subnormal rounds to 0 (flushed);
between that and the smallest normal it survives with fewer significant bits (subnormal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FormatLimits:
    name: str
    smallest_subnormal: float
    smallest_normal: float
    largest: float
    eps: float  # spacing of numbers at 1.0 (2^-mantissa_bits); relative rounding error <= eps / 2


def limits(dtype: torch.dtype) -> FormatLimits:
    """The limits of a floating-point dtype, from torch.finfo."""
    if not dtype.is_floating_point:
        raise ValueError(f"limits: {dtype} is not a floating-point dtype; use torch.float16, bfloat16 or float32")
    fi = torch.finfo(dtype)
    return FormatLimits(str(dtype).removeprefix("torch."), fi.smallest_normal * fi.eps, fi.smallest_normal,
                        fi.max, fi.eps)


@dataclass(frozen=True)
class CastReport:
    """What casting (values x scale) to a format did to the nonzero values (fractions of them)."""

    scale: float
    nonzero: int
    flushed: float  # became exactly 0
    subnormal: float  # survived, but below the smallest normal: fewer significant bits
    overflowed: float  # became +-inf
    max_relative_error: float  # over the values that stayed finite and nonzero


# --8<-- [start:cast-report]
@torch.no_grad()
def cast_report(values: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> CastReport:
    """Cast ``values * scale`` (computed in float64, so only the cast rounds) to `dtype`."""
    if scale <= 0:
        raise ValueError(f"cast_report scale={scale}: it must be > 0")
    exact = values.detach().double().flatten() * scale
    exact = exact[exact != 0]  # true zeros cannot be lost
    n = exact.numel()
    if n == 0:
        return CastReport(scale, 0, 0.0, 0.0, 0.0, 0.0)
    cast = exact.to(dtype).double()
    flushed = cast == 0
    overflowed = cast.isinf()
    kept = ~(flushed | overflowed)
    subnormal = kept & (cast.abs() < torch.finfo(dtype).smallest_normal)
    rel = ((cast[kept] - exact[kept]).abs() / exact[kept].abs()).max().item() if kept.any() else 0.0
    return CastReport(scale, n, flushed.sum().item() / n, subnormal.sum().item() / n,
                      overflowed.sum().item() / n, rel)
# --8<-- [end:cast-report]
