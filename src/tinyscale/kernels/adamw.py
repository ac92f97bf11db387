"""Fused AdamW over one flat buffer: one kernel reads p, g, m, v once and writes p, m, v.

torch's single-tensor AdamW launches ~10 elementwise kernels per parameter (each a full pass
over memory); `foreach` batches launches across tensors but still makes several passes. On a
flat buffer (the shape of a ZeRO shard) one kernel does it all, 4 reads and 3 writes per
element, the minimum. The arithmetic is AdamW's as torch writes it, so results match:

    p *= 1 - lr * wd                 m += (1 - b1) (g - m)        v = b2 v + (1 - b2) g^2
    p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

The bias corrections are scalars computed once on the host per step.
Lesson: lessons/11-kernels.md. Tests: `pytest -k kernels_adamw`.
"""

import math

import torch

from tinyscale.kernels._triton import jit, tl, triton, use_triton

# No `from __future__ import annotations`: Triton reads the kernels' `tl.constexpr` annotations.


def adamw_reference_(p, g, m, v, *, lr, beta1, beta2, eps, weight_decay, step) -> None:
    """AdamW's update in place on flat tensors, written as torch's single-tensor AdamW does it."""
    p.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - beta1**step))


# --8<-- [start:kernel]
@jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, lr, beta1, beta2, eps, decay, step_size, sqrt_bc2,
                  BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    p = p * (1 - lr * decay)
    m = m + (1 - beta1) * (g - m)
    v = beta2 * v + (1 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / sqrt_bc2 + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
# --8<-- [end:kernel]


def fused_adamw_(p, g, m, v, *, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step: int,
                 block: int = 1024) -> None:
    """One AdamW step in place on flat, contiguous, same-dtype buffers (p, grad, exp_avg, exp_avg_sq)."""
    for name, t in (("grad", g), ("exp_avg", m), ("exp_avg_sq", v)):
        if t.shape != p.shape or t.dtype != p.dtype or not t.is_contiguous():
            raise ValueError(f"fused_adamw_: {name} must be contiguous with p's shape {tuple(p.shape)} and dtype "
                             f"{p.dtype}; got {tuple(t.shape)}, {t.dtype}")
    if step < 1:
        raise ValueError(f"fused_adamw_: step={step} must be >= 1 (the bias corrections divide by 1 - beta^step)")
    if not (use_triton(p) and p.dtype != torch.float64 and p.is_contiguous()):
        return adamw_reference_(p, g, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                                step=step)
    n = p.numel()
    _adamw_kernel[(triton.cdiv(n, block),)](p, g, m, v, n, lr, beta1, beta2, eps, weight_decay,
                                            lr / (1 - beta1**step), math.sqrt(1 - beta2**step), BLOCK=block)


class FusedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update, one fused kernel per parameter (on a ZeRO shard: one per
    flat piece). Pass it where an optimizer factory goes, e.g. `ts.initialize(model, config,
    optimizer=FusedAdamW)`: ZeRO steps its 1-D shards with it. Elementwise, so ZeRO-safe."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:  # unused: not stepped, as torch's AdamW
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                fused_adamw_(p.view(-1), p.grad.reshape(-1).contiguous(), state["exp_avg"].view(-1),
                             state["exp_avg_sq"].view(-1), lr=group["lr"], beta1=beta1, beta2=beta2,
                             eps=group["eps"], weight_decay=group["weight_decay"], step=int(state["step"]))
