"""Fused linear + cross-entropy, chunked: the (rows, vocab) logits never exist all at once.

For a language model's last layer, logits = h W^T are (N, V): at N = 8 x 4096 tokens and
V = 128k that is 4 GiB in fp32 before the softmax makes another copy and backward a third.
Here rows go `chunk` at a time: compute the chunk's logits, let one kernel per row find the
log-sum-exp (an online max and sum over the vocabulary in blocks), write the row's loss and
overwrite the logits *in place* with their gradient (softmax - one_hot) / n_valid, then
turn that into the chunk's dh = dlogits W and its share of dW = dlogits^T h, and drop the
logits. Peak extra memory: chunk x V logits instead of N x V (measured in the tests).
Gradients are computed in the forward (as Liger-Kernel's fused linear cross-entropy does);
backward only scales them by the incoming gradient of the loss.

Targets equal to `ignore_index` give no loss and no gradient, and are not counted in the
mean, as in `F.cross_entropy`.

Shape legend: N rows (tokens), C hidden size, V vocabulary, c rows per chunk.
Lesson: lessons/11-kernels.md. Tests: `pytest -k kernels_cross_entropy`.
"""

import torch

from tinyscale.kernels._triton import jit, tl, triton, use_triton

# No `from __future__ import annotations`: Triton reads the kernels' `tl.constexpr` annotations.

IGNORE_INDEX = -100


# --8<-- [start:kernel]
@jit
def _ce_rows(LOGITS, TARGETS, LOSS, V, inv_count, IGNORE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = LOGITS + row * V
    target = tl.load(TARGETS + row)
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # per-lane running max and sum of exp
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    top = tl.max(m, axis=0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))  # the row's log-sum-exp
    valid = target != IGNORE
    x_t = tl.load(base + tl.where(valid, target, 0)).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - x_t, 0.0))
    for start in range(0, V, BLOCK):  # the logits become their gradient, in place
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
        g = tl.where(valid, g * inv_count, 0.0)
        tl.store(base + cols, g.to(LOGITS.dtype.element_ty), mask=cols < V)
# --8<-- [end:kernel]


def _rows_reference(logits: torch.Tensor, targets: torch.Tensor, inv_count: float) -> torch.Tensor:
    """The kernel's work in PyTorch: per-row losses, and logits overwritten by their gradient."""
    valid = targets != IGNORE_INDEX
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)  # (c,)
    picked = x.gather(1, torch.where(valid, targets, 0)[:, None])[:, 0]
    grad = torch.softmax(x, dim=-1)
    grad[torch.arange(len(targets)), torch.where(valid, targets, 0)] -= valid.to(grad.dtype)
    logits.copy_(grad * valid[:, None] * inv_count)
    return torch.where(valid, lse - picked, torch.zeros_like(lse))


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk: int):
        N, C = h.shape
        V = weight.shape[0]
        count = int((targets != IGNORE_INDEX).sum())
        inv = 1.0 / max(count, 1)
        losses = torch.empty(N, dtype=torch.float32, device=h.device)
        # dW sums over every chunk: in float32 at least, so bf16/fp16 weights are not rounded once per chunk
        dh, dw = torch.empty_like(h), torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32))
        for start in range(0, N, chunk):
            rows = slice(start, min(start + chunk, N))
            logits = h[rows] @ weight.T  # (c, V): the only logits alive at any time
            t = targets[rows].contiguous()
            if use_triton(logits) and logits.dtype != torch.float64:
                _ce_rows[(logits.shape[0],)](logits, t, losses[rows], V, inv, IGNORE=IGNORE_INDEX,
                                             BLOCK=min(1024, triton.next_power_of_2(V)))
            else:
                losses[rows] = _rows_reference(logits, t, inv)
            dh[rows] = logits @ weight  # (c, V) @ (V, C): logits hold dlogits now
            dw += logits.T @ h[rows]  # (V, c) @ (c, C): rounded to the format once per chunk, summed in float32
            del logits
        ctx.save_for_backward(dh, dw)
        ctx.weight_dtype = weight.dtype
        return losses.sum() * inv

    @staticmethod
    def backward(ctx, grad_loss):
        dh, dw = ctx.saved_tensors
        return dh * grad_loss, (dw * grad_loss).to(ctx.weight_dtype), None, None


def fused_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                               chunk: int = 1024) -> torch.Tensor:
    """mean cross-entropy of (h W^T) against targets, h (N, C), weight (V, C), targets (N,),
    computed `chunk` rows at a time (the kernel where Triton runs, the same math in PyTorch
    otherwise). Equals F.cross_entropy(h @ weight.T, targets, ignore_index=-100)."""
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1] or targets.shape != h.shape[:1]:
        raise ValueError(f"fused_linear_cross_entropy: h {tuple(h.shape)}, weight {tuple(weight.shape)}, targets "
                         f"{tuple(targets.shape)} must be (N, C), (V, C), (N,)")
    if chunk < 1:
        raise ValueError(f"fused_linear_cross_entropy: chunk={chunk} must be >= 1 (rows per chunk)")
    return _FusedLinearCE.apply(h, weight, targets, chunk)
