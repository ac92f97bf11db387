"""Grouped GEMM: many small matmuls, one per group of contiguous rows, in one kernel launch.

    y = grouped_gemm(x, w, counts)     # rows counts[0] of x times w[0], the next counts[1] times w[1], ...

A mixture-of-experts layer sorts its tokens by expert (`tinyscale.moe`); expert g then multiplies
its run of rows x[s_g : s_g + n_g] (n_g, K) by its own weight w[g] (K, N). The reference is that
loop, one matmul per expert: E kernel launches, each on a small, ragged problem. The Triton
kernel tiles every group's (n_g, N) output into BM x BN blocks and runs them all in one launch
(grid: groups x row tiles x column tiles; a tile past its group's rows returns at once), as
MegaBlocks' and torch's `_grouped_mm` do. Backward is two more grouped products:

    dx_g = dy_g w_g^T   (the same kernel on w transposed)      dw_g = x_g^T dy_g   (a second kernel)

Shape legend: M rows (sum of counts), K input width, N output width, G groups.
Lesson: lessons/13-moe.md. Tests: `pytest -k kernels_grouped_gemm`.
"""

# No `from __future__ import annotations`: Triton reads the kernels' `tl.constexpr` annotations.

import torch

from tinyscale.kernels._triton import jit, tl, triton, use_triton


# --8<-- [start:reference]
def grouped_gemm_reference(x: torch.Tensor, w: torch.Tensor, counts) -> torch.Tensor:
    """The loop: x (M, K) with rows grouped by `counts` (G ints), w (G, K, N) -> (M, N)."""
    outs, start = [], 0
    for g, n in enumerate(int(c) for c in counts):
        outs.append(x[start:start + n] @ w[g])  # (n_g, K) @ (K, N) -> (n_g, N)
        start += n
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[-1])
# --8<-- [end:reference]


@jit
def _grouped_forward(x_ptr, w_ptr, y_ptr, offsets_ptr, K, N, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr):
    g, tile_m, tile_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(offsets_ptr + g)
    rows = tl.load(offsets_ptr + g + 1) - start
    if tile_m * BM < rows:  # tiles past this group's rows do nothing
        m = tile_m * BM + tl.arange(0, BM)  # (BM,) rows within the group
        n = tile_n * BN + tl.arange(0, BN)  # (BN,)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            a = tl.load(x_ptr + (start + m[:, None]) * K + k[None, :],
                        mask=(m[:, None] < rows) & (k[None, :] < K), other=0.0).to(tl.float32)  # (BM, BK)
            b = tl.load(w_ptr + g * K * N + k[:, None] * N + n[None, :],
                        mask=(k[:, None] < K) & (n[None, :] < N), other=0.0).to(tl.float32)  # (BK, BN)
            acc += tl.dot(a, b)
        tl.store(y_ptr + (start + m[:, None]) * N + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(m[:, None] < rows) & (n[None, :] < N))


@jit
def _grouped_weight_grad(x_ptr, dy_ptr, dw_ptr, offsets_ptr, K, N, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr):
    g, tile_k, tile_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(offsets_ptr + g)
    rows = tl.load(offsets_ptr + g + 1) - start
    k = tile_k * BK + tl.arange(0, BK)
    n = tile_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BK, BN), dtype=tl.float32)
    for m0 in range(0, rows, BM):  # dw_g = x_g^T dy_g, summed over the group's rows
        m = m0 + tl.arange(0, BM)
        a = tl.load(x_ptr + (start + m[None, :]) * K + k[:, None],
                    mask=(m[None, :] < rows) & (k[:, None] < K), other=0.0).to(tl.float32)  # (BK, BM)
        b = tl.load(dy_ptr + (start + m[:, None]) * N + n[None, :],
                    mask=(m[:, None] < rows) & (n[None, :] < N), other=0.0).to(tl.float32)  # (BM, BN)
        acc += tl.dot(a, b)
    tl.store(dw_ptr + g * K * N + k[:, None] * N + n[None, :], acc.to(dw_ptr.dtype.element_ty),
             mask=(k[:, None] < K) & (n[None, :] < N))


_BLOCK = 16  # tl.dot's smallest tile; a GPU would autotune larger ones


def _forward(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, max_rows: int) -> torch.Tensor:
    M, K = x.shape
    G, _, N = w.shape
    y = x.new_empty(M, N)
    if M:
        grid = (G, triton.cdiv(max(max_rows, 1), _BLOCK), triton.cdiv(N, _BLOCK))
        _grouped_forward[grid](x, w, y, offsets, K, N, BM=_BLOCK, BN=_BLOCK, BK=_BLOCK)
    return y


class _GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets, max_rows):
        ctx.save_for_backward(x, w, offsets)
        ctx.max_rows = max_rows
        return _forward(x, w, offsets, max_rows)

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _forward(dy, w.transpose(1, 2).contiguous(), offsets, ctx.max_rows)  # dy_g w_g^T
        G, K, N = w.shape
        dw = torch.empty_like(w)
        _grouped_weight_grad[(G, triton.cdiv(K, _BLOCK), triton.cdiv(N, _BLOCK))](
            x, dy, dw, offsets, K, N, BM=_BLOCK, BN=_BLOCK, BK=_BLOCK)
        return dx, dw, None, None


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, counts) -> torch.Tensor:
    """x (M, K) grouped by `counts` (G ints, summing to M) times w (G, K, N) -> (M, N), differentiable.
    The Triton kernel for float32/16 on a GPU (or the CPU under TRITON_INTERPRET=1), else the loop."""
    counts = [int(c) for c in counts]
    if sum(counts) != x.shape[0] or len(counts) != w.shape[0]:
        raise ValueError(f"grouped_gemm: counts {counts} must be one per group of w {tuple(w.shape)} and "
                         f"sum to x's {x.shape[0]} rows")
    if not (use_triton(x) and x.dtype in (torch.float32, torch.float16, torch.bfloat16)):
        return grouped_gemm_reference(x, w, counts)
    offsets = torch.tensor([0] + counts, device=x.device).cumsum(0)  # (G + 1,)
    return _GroupedGemm.apply(x.contiguous(), w.contiguous(), offsets, max(counts, default=0))
