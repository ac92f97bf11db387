"""Sweep the fused dropout + residual + LayerNorm kernel's warps on a GPU (lesson 11, DS-32).

    python scripts/gpu_fused_norm.py        # bf16, (8, 1024, 4096): ms forward and forward + backward per setting

One process, CUDA only; eager `LayerNorm(residual + F.dropout(x))` timed in the same run as the baseline.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from tinyscale.kernels import fused_norm


def main() -> None:
    torch.manual_seed(0)
    B, T, C, dtype = 8, 1024, 4096, torch.bfloat16
    x, r = (torch.randn(B, T, C, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    w, b = torch.ones(C, device="cuda", dtype=dtype, requires_grad=True), torch.zeros(C, device="cuda", dtype=dtype,
                                                                                         requires_grad=True)
    g = torch.randn(B, T, C, device="cuda", dtype=dtype)

    def eager():
        h = r + F.dropout(x, 0.1)
        return F.layer_norm(h, (C,), w, b), h

    def fused():
        return fused_norm.fused_dropout_residual_layer_norm(x, r, w, b, p=0.1, key=1234)

    def both(fn):
        y, h = fn()
        torch.autograd.backward((y, h), (g, g))

    print(f"{'setting':>10} {'fwd ms':>8} {'fwd+bwd ms':>11}")
    print(f"{'eager':>10} {do_bench(eager):8.3f} {do_bench(lambda: both(eager)):11.3f}")
    for warps in (None, 4, 8, 16, 32):
        fused_norm.WARPS = warps
        name = f"rule {fused_norm._warps(4096)}" if warps is None else str(warps)
        print(f"{name:>10} {do_bench(fused):8.3f} {do_bench(lambda: both(fused)):11.3f}")


if __name__ == "__main__":
    main()
