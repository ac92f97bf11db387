"""Stochastic quantization to 8 or 4 bits, unbiased: QSGD (Alistarh et al. 2017) and its
max-norm variant.

Every element becomes a signed integer level in [-s, s], s = 2^(bits-1) - 1 (127 or 7),
against a scale every rank agrees on first (one all-reduce MAX of one number). Rounding is
stochastic: y = |x| / scale * s lies between the levels floor(y) and floor(y) + 1, and rounds
up with probability y - floor(y), so the expected level is y itself and
E[decompress(compress(x))] = x: the estimate is unbiased, its variance exactly
sum_i (scale / s)^2 f_i (1 - f_i), f_i = y_i - floor(y_i), so at most scale^2 / (4 s^2) per element.

The scale (`norm`) is what tells the two apart:
- "l2": QSGD as the paper defines its quantiser Q_s: scale = ||x||_2 (over the group: the
  largest rank's). The paper's bound: E||Q(x) - x||^2 <= min(n / s^2, sqrt(n) / s) ||x||^2.
- "max": scale = max |x|, a finer grid (max |x| <= ||x||_2) for the same bits, so a smaller
  variance, n max^2 / (4 s^2) at most. It is not the paper's QSGD; tinyscale's earlier
  "qsgd" was this one, and it stays the default so that measurements made with it stand.
Lesson 10 measures both against their bounds (`pytest -k compression_qsgd_norm`).

Why agree on the scale: with one scale every rank's codes mean the same thing, and with a
scale that can be zero (an all-zero gradient) the codes are zero, never NaN. Codes are still
all-gathered, not all-reduced: a sum of N int8 codes overflows int8. Four-bit codes are packed
two per byte (an int4 "stored in int8" saves nothing over int8).

Shape legend: n elements. Lesson: lessons/10-compression.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tinyscale.compression.base import Compressor, Payload, _check_flat
from tinyscale.dist import comm
from tinyscale.kernels import dequantize_int8, quantize_int8

BITS = (8, 4)
NORMS = ("max", "l2")


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-7, 7] (n,) -> uint8 (ceil(n/2),), two codes per byte (low nibble first)."""
    u = (codes.to(torch.int16) + 8).to(torch.uint8)  # [1, 15]: fits 4 bits
    if u.numel() % 2:
        u = torch.cat([u, u.new_zeros(1)])
    return u[0::2] | (u[1::2] << 4)


def unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The inverse of `pack_nibbles`: uint8 (ceil(n/2),) -> int8 codes (n,)."""
    u = torch.stack([packed & 15, packed >> 4], dim=1).view(-1)[:numel]  # (n,) interleaved back
    return (u.to(torch.int16) - 8).to(torch.int8)


# --8<-- [start:qsgd]
class QSGD(Compressor):
    """Unbiased stochastic quantization to `bits` (8 or 4) with a scale agreed over the group:
    the largest ||x||_2 (norm "l2", the paper's QSGD) or the largest |x| (norm "max")."""

    def __init__(self, bits: int = 8, seed: int = 0, norm: str = "max"):
        if bits not in BITS:
            raise ValueError(f"QSGD: bits={bits} is not supported; use one of {BITS}")
        if norm not in NORMS:
            raise ValueError(f"QSGD: norm={norm!r} is not supported; use one of {NORMS}")
        self.bits, self.levels, self.seed, self.norm = bits, 2 ** (bits - 1) - 1, seed, norm
        self.scale: torch.Tensor | None = None
        self._gen: torch.Generator | None = None
        self._gen_state: torch.Tensor | None = None  # a loaded position, applied when the generator is made

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach()
        return (x.norm() if self.norm == "l2" else x.abs().max()).reshape(1).clone()  # (1,)

    def agree(self, x: torch.Tensor, group=None) -> None:
        scale = self._scale(x)  # the max over ranks: every rank's codes then mean the same thing
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            comm.all_reduce(scale, op=comm.ReduceOp.MAX, group=group)
        self.scale = scale

    def _generator(self, device) -> torch.Generator:
        if self._gen is None:  # each rank its own stream (independent rounding), reproducible
            rank = dist.get_rank() if dist.is_initialized() else 0
            self._gen = torch.Generator(device=device).manual_seed(self.seed + 1_000_003 * rank)
            if self._gen_state is not None:
                self._gen.set_state(self._gen_state)
        return self._gen

    def state_dict(self) -> dict:
        state = self._gen.get_state() if self._gen is not None else self._gen_state
        return {} if state is None else {"generator": state}

    def load_state_dict(self, state: dict) -> None:
        self._gen, self._gen_state = None, state.get("generator")

    def compress(self, x: torch.Tensor) -> Payload:
        _check_flat(x, "QSGD.compress")
        scale = self.scale if self.scale is not None else self._scale(x)
        self.scale = None  # one agreed scale per compress
        safe = scale.clamp_min(torch.finfo(x.dtype).tiny)  # an all-zero x gives zero codes, not NaN
        y = x.abs() / safe * self.levels  # (n,) in [0, s]
        low = y.floor()
        up = torch.rand(y.shape, generator=self._generator(x.device), dtype=y.dtype, device=y.device) < (y - low)
        codes = (torch.sign(x) * (low + up)).to(torch.int8)  # (n,) in [-s, s]
        wire = pack_nibbles(codes) if self.bits == 4 else codes
        return Payload({"codes": wire}, x.numel(), x.dtype, {"scale": scale})

    def decompress(self, payload: Payload) -> torch.Tensor:
        codes = payload.tensors["codes"]
        if self.bits == 4:
            codes = unpack_nibbles(codes, payload.numel)
        return codes.to(payload.dtype) * (payload.meta["scale"] / self.levels)
# --8<-- [end:qsgd]

    def wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel if self.bits == 8 else (numel + 1) // 2

    def agree_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return dtype.itemsize  # the max |x|, all-reduced once


class BlockInt8(Compressor):
    """Deterministic int8 with one scale per `block` elements (round to nearest), by the fused
    kernel `tinyscale.kernels.quantize_int8` where Triton runs. Biased (no random rounding),
    so use it with error feedback; per-block scales follow outliers locally, where QSGD's one
    scale lets a single large element flatten everything else to zero."""

    def __init__(self, block: int = 256):
        self.block = block

    def compress(self, x: torch.Tensor) -> Payload:
        _check_flat(x, "BlockInt8.compress")
        codes, scales = quantize_int8(x, self.block)
        return Payload({"codes": codes, "scales": scales.to(x.dtype)}, x.numel(), x.dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        scales = payload.tensors["scales"].float()
        return dequantize_int8(payload.tensors["codes"], scales, self.block).to(payload.dtype)

    def wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel + -(-numel // self.block) * dtype.itemsize
