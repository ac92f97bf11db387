"""Whether a Triton kernel can run on a tensor, and the one import guard for the package.

Triton is optional (`pip install -e .[triton]`). A kernel runs when Triton is importable and
the tensor is on a GPU, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`, set
before Triton is imported: the tests' conftest does it). Otherwise each topic function runs
its PyTorch reference, the same math written for reading.
"""

from __future__ import annotations

import os

import torch

try:  # pragma: no cover - depends on the install
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover
    class _NoTriton:  # lets kernel signatures (`BLOCK: tl.constexpr`) be defined without Triton
        constexpr = int
    triton, tl = None, _NoTriton()
    HAS_TRITON = False


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton kernel for `t` (else the PyTorch reference)."""
    return HAS_TRITON and (t.is_cuda or (t.device.type == "cpu" and interpreting()))


def jit(fn):
    """`triton.jit` when Triton is installed; otherwise the function stays a plain (unused) one."""
    return triton.jit(fn) if HAS_TRITON else fn
