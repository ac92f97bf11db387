"""The Triton grouped GEMM equals its reference, the loop of one matmul per group (float32; on
the CPU under Triton's interpreter, which the root conftest selects). Run: `pytest -k kernels_grouped_gemm`.

Tolerance: float32 dot products of at most 40 terms of O(1) values, summed in another order
(tiles of 16): a few ulps (~1e-6 relative); 1e-5 leaves margin, while a row sent to the wrong
group's weight or a dropped tile is off by O(1).
"""

from __future__ import annotations

import pytest
import torch

from tinyscale.kernels import HAS_TRITON
from tinyscale.kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (pip install -e .[triton])")
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("counts,K,N", [([5, 0, 19, 1], 24, 20), ([17], 8, 40)])
def test_kernels_grouped_gemm_forward_and_backward_equal_the_loop(counts, K, N):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), K, generator=gen).requires_grad_(True)
    w = torch.randn(len(counts), K, N, generator=gen).requires_grad_(True)
    x_ref, w_ref = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    y, y_ref = grouped_gemm(x, w, counts), grouped_gemm_reference(x_ref, w_ref, counts)
    assert y.grad_fn is not None and "GroupedGemm" in type(y.grad_fn).__name__, "the kernel ran, not the loop"
    torch.testing.assert_close(y, y_ref, **TOL)
    dy = torch.randn(y.shape, generator=gen)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    torch.testing.assert_close(w.grad, w_ref.grad, **TOL)


def test_kernels_grouped_gemm_refuses_counts_that_do_not_cover_the_rows():
    with pytest.raises(ValueError, match="sum to x's 4 rows"):
        grouped_gemm(torch.zeros(4, 3), torch.zeros(2, 3, 5), [1, 2])
