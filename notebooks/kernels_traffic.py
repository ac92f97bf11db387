"""Bytes each kernel moves through memory, fused and unfused, for notebooks/11-kernels.ipynb
(lesson 11, "Kernels") and benchmarks/kernels.py.

- `eager_traffic(fn)`: run `fn` under a dispatch mode and add up, for every ATen op eager
  PyTorch launches, the bytes of its tensor inputs (read) and outputs (written). Views move
  nothing and are skipped; a broadcast (stride-0) dim is counted once. Run it on `meta`
  tensors and the shapes can be a real model's: nothing is allocated or computed.
- `eager_ops(fn)`: the names of those ops, in order (what a profiler's kernel list would show).
- `fused_traffic(kernel, **shape)`: the bytes the Triton kernel's own loads and stores move,
  read off `src/tinyscale/kernels/` (each formula names the loads and stores it counts).
- `flops(kernel, **shape)`: the arithmetic, for the roofline.

Both traffic counts assume every load misses the cache, as a kernel streaming a tensor
larger than L2 (50 MiB on an H100) does; small tensors that stay in L2 cost less than this.
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements of t (a stride-0, broadcast dim holds one)."""
    return math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0) * t.element_size()


class _Traffic(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.kernels, self.bytes, self.ops = 0, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:  # a view is metadata: no kernel, no bytes
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.kernels += 1
            self.ops.append(str(func.overloadpacket.__name__))
            self.bytes += sum(_bytes(t) for t in tensors)
        return out


def eager_traffic(fn) -> tuple[int, int]:
    """(ATen kernels launched, bytes read + written) by eager PyTorch running fn()."""
    with _Traffic() as mode:
        fn()
    return mode.kernels, mode.bytes


def eager_ops(fn) -> list[str]:
    """The names of the ATen ops (views left out) eager PyTorch launches running fn(), in order."""
    with _Traffic() as mode:
        fn()
    return mode.ops


def fused_traffic(kernel: str, *, e: int = 4, **s) -> int:
    """Bytes the fused kernel loads and stores (e bytes per element of the main tensors)."""
    if kernel == "rmsnorm":  # load x (R, N) and w (N); store y (R, N) and rstd (R,) float32
        R, N = s["R"], s["N"]
        return 2 * R * N * e + N * e + 4 * R
    if kernel == "fused_norm":  # load x, residual (R, N), w, b (N); store y, h (R, N), mean, rstd (R,) float32
        R, N = s["R"], s["N"]
        return 4 * R * N * e + 2 * N * e + 8 * R
    if kernel == "fused_norm_backward":  # load h, dy, dh, w, mean, rstd; store dx, dresidual and, per
        R, N, P = s["R"], s["N"], s["P"]  # program (P of them), float32 dw and db partials, summed by torch
        return 5 * R * N * e + N * e + 8 * R + 2 * 2 * 4 * P * N
    if kernel == "adamw":  # load p, g, m, v; store p, m, v: 7 passes over n elements
        return 7 * s["n"] * e
    if kernel == "quantize":  # load x; store int8 codes and one float32 scale per block
        n = s["n"]
        return n * e + n + 4 * math.ceil(n / s["block"])
    if kernel == "attention":  # forward: Q once, K and V once per query tile, O out, lse float32
        B, H, T, D, BM = s["B"], s["H"], s["T"], s["D"], s["BM"]  # K/V heads: each query head reads its own
        tiles = math.ceil(T / BM)
        kv_reads = 2 * B * H * tiles * T * D * e  # each query head's program reads its K/V head
        if s.get("causal", True):
            kv_reads = kv_reads * (tiles + 1) // (2 * tiles)  # tile i reads i + 1 of the tiles
        return 2 * B * H * T * D * e + kv_reads + 4 * B * H * T
    if kernel == "cross_entropy":  # fused_linear_cross_entropy's loop, forward and backward, c rows a chunk
        N, C, V, c = s["N"], s["C"], s["V"], s["c"]
        chunks = math.ceil(N / c)
        # per chunk: logits = h W^T stores (c, V); the kernel loads them twice and stores them once;
        # the dh and dW matmuls load them once each
        logits = 6 * N * V * e
        # W loaded by the logits and dh matmuls; dW's (V, C) product stored, then dw += it (2 loads, 1 store)
        weight = 6 * chunks * V * C * e
        # h loaded by two matmuls; dh's product stored, then copied into dh[rows] (load + store)
        rows = 5 * N * C * e
        return logits + weight + rows + 8 * N + 4 * N  # + int64 targets loaded, float32 losses stored
    raise ValueError(f"fused_traffic: unknown kernel {kernel!r}")


def flops(kernel: str, **s) -> int:
    """FLOPs of one call (multiply-add = 2), counting what the fused kernel computes."""
    if kernel == "rmsnorm":  # square, sum, scale, weight: ~4 per element
        return 4 * s["R"] * s["N"]
    if kernel == "adamw":  # ~16 per element (decay, two moments, sqrt, divide, update)
        return 16 * s["n"]
    if kernel == "quantize":  # abs, max, divide, round, clamp: ~5 per element
        return 5 * s["n"]
    if kernel == "attention":  # QK^T and PV: 2 matmuls of 2 T T D per head; causal: half
        full = 4 * s["B"] * s["H"] * s["T"] ** 2 * s["D"]
        return full // 2 if s.get("causal", True) else full
    if kernel == "cross_entropy":  # logits, dh, dW: 3 matmuls of 2 N V C
        return 6 * s["N"] * s["V"] * s["C"]
    raise ValueError(f"flops: unknown kernel {kernel!r}")
