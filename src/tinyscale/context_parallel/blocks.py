"""One block of attention on the fastest exact kernel the device has, with merge.py's contract.

`attend(q, k, v, ...) -> (out, lse)` and `attend_backward(dout, q, k, v, out, lse, ...) ->
(dq, dk, dv)` are what ring attention and Ulysses call for each block. In order:

1. Triton (`tinyscale.kernels.flash_block`) where it runs: a GPU, or float32 under the CPU
   interpreter (`kernel_ok`).
2. The CPU's fused flash kernel, `aten._scaled_dot_product_flash_attention_for_cpu`, for
   float64, float32 and bfloat16: it returns the row log-sum-exp a merge needs, and its
   backward takes the merged lse, so the scores are never materialised. It groups query
   heads onto K/V heads itself (GQA, head h reads K/V head h // (H / K)). Float64 runs it too:
   it agrees with merge.py's float64 reference to about 1e-15 (tests/context_parallel
   -k cp_blocks), so the equivalence tests exercise the kernel the benchmarks time.
3. merge.py's `block_attention` (materialised scores) otherwise, and always with dropout
   (the counter masks are merge.py's).

The kernel gives a row that sees no key lse 0 and out 0; merge.py's contract is lse -inf, so
such rows are set to -inf here (a block of only padded keys is skipped outright).

Shape legend: B batch, H query heads, K key/value heads, Tq query rows, Tk keys, D head dim.
Lesson: lessons/09-context-parallel.md. Tests: `pytest tests/context_parallel -k cp_blocks`.
"""

from __future__ import annotations

import torch

from tinyscale.context_parallel.merge import (
    _finite_or_zero, _mask, block_attention, block_attention_backward, check_mask_kind,
)
from tinyscale.kernels import flash_block, flash_block_backward, kernel_ok

CPU_FLASH_DTYPES = (torch.float64, torch.float32, torch.bfloat16)


def cpu_flash_ok(q: torch.Tensor) -> bool:
    """The CPU flash kernel runs for `q` (and Triton does not)."""
    return q.device.type == "cpu" and q.dtype in CPU_FLASH_DTYPES and not kernel_ok(q)


def _flash_mask(Tq: int, Tk: int, kind: str, key_valid: torch.Tensor | None, dtype, device):
    """(is_causal, additive mask (Tq | 1, Tk) or None) for the kernel; None mask when no key is padded."""
    if key_valid is None or bool(key_valid.all()):
        check_mask_kind(Tq, Tk, kind)  # no (Tq, Tk) mask built: 4 M elements at Tq = Tk = 2048
        return kind == "causal", None
    allowed = _mask(Tq, Tk, kind, key_valid, device)  # (Tq, Tk) bool
    if kind == "full":
        allowed = allowed[:1]  # the same for every row: (1, Tk), broadcast by the kernel
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return False, mask.masked_fill_(~allowed, float("-inf"))


def _blind_rows(Tq: int, kind: str, key_valid: torch.Tensor | None) -> torch.Tensor | None:
    """(Tq,) bool: rows that see no key in this block (None: every row sees one)."""
    if key_valid is None:
        return None
    seen = key_valid.cumsum(0)[:Tq] if kind == "causal" else key_valid.any().expand(Tq)  # keys visible to row i
    blind = seen == 0
    return blind if bool(blind.any()) else None


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


# --8<-- [start:attend]
def attend(q, k, v, *, causal_mask_kind: str, scale: float, key_valid=None, dropout_scale=None):
    """One block: out (B, H, Tq, D) in q's dtype, lse (B, H, Tq) in at least float32."""
    if dropout_scale is None and kernel_ok(q):
        return flash_block(q, k, v, causal_mask_kind=causal_mask_kind, scale=scale, key_valid=key_valid)
    if dropout_scale is not None or not cpu_flash_ok(q):
        return block_attention(q, k, v, causal_mask_kind=causal_mask_kind, scale=scale, key_valid=key_valid,
                               dropout_scale=dropout_scale)
    B, H, Tq, D = q.shape
    if key_valid is not None and not bool(key_valid.any()):  # only padded keys: nothing to see
        return q.new_zeros(B, H, Tq, D), torch.full((B, H, Tq), float("-inf"), dtype=_lse_dtype(q), device=q.device)
    causal, mask = _flash_mask(Tq, k.shape[2], causal_mask_kind, key_valid, q.dtype, q.device)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                         scale=scale)
    blind = _blind_rows(Tq, causal_mask_kind, key_valid)
    if blind is not None:  # the kernel says lse 0 there; the merge needs -inf (weight 0)
        lse = lse.masked_fill(blind, float("-inf"))
    return out, lse.to(_lse_dtype(q))
# --8<-- [end:attend]


def attend_backward(dout, q, k, v, out, lse, *, causal_mask_kind: str, scale: float, key_valid=None,
                    dropout_scale=None):
    """Gradients of one block given the rows' merged out and lse: dq (B, H, Tq, D), dk, dv
    (B, K, Tk, D); in at least float32 on merge.py's path, else in the kernel's dtype."""
    if dropout_scale is None and kernel_ok(q):
        return flash_block_backward(dout, q, k, v, out, lse, causal_mask_kind=causal_mask_kind, scale=scale,
                                    key_valid=key_valid)
    if dropout_scale is not None or not cpu_flash_ok(q):
        return block_attention_backward(dout, q, k, v, out, lse, causal_mask_kind=causal_mask_kind, scale=scale,
                                        key_valid=key_valid, dropout_scale=dropout_scale)
    if key_valid is not None and not bool(key_valid.any()):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    causal, mask = _flash_mask(q.shape[2], k.shape[2], causal_mask_kind, key_valid, q.dtype, q.device)
    # rows with merged lse -inf see no key anywhere: their scores are all -inf, so any finite lse gives P = 0
    lse = _finite_or_zero(lse).to(_lse_dtype(q))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, 0.0, causal, attn_mask=mask, scale=scale)


class BlockAttention(torch.autograd.Function):
    """`attend` with `attend_backward` as its gradient (Ulysses' one full-sequence block)."""

    @staticmethod
    def forward(ctx, q, k, v, causal_mask_kind: str, scale: float, key_valid):
        out, lse = attend(q, k, v, causal_mask_kind=causal_mask_kind, scale=scale, key_valid=key_valid)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kind, ctx.scale, ctx.key_valid = causal_mask_kind, scale, key_valid
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attend_backward(dout, q, k, v, out, lse, causal_mask_kind=ctx.kind, scale=ctx.scale,
                                     key_valid=ctx.key_valid)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
