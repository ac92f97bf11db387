"""K/V heads replicated when there are fewer of them than ranks (GQA/MQA with n_kv_head < t).

With K K/V heads, H query heads and t ranks where t % K == 0, rank r holds query heads
[r*H/t, (r+1)*H/t), which all read K/V head r // (t/K): each K/V head's weight rows (D, C) are
copied onto the t/K ranks that need it (Megatron-LM and vLLM do the same).

Gradients: the input's gradient is already right (f all-reduces the sum over ranks of each
rank's contribution through its query heads). The weight's is not: each copy sees only its
rank's query heads, so the dense gradient of head j is the sum over the t/K copies. The
backward all-reduces over the TP group a (K, D, C) buffer holding this rank's partial gradient
at its head's index (zeros elsewhere) and keeps its head: one all-reduce of the full K*D*C
weight per layer, where a subgroup per head would move D*C, but no extra process groups.
`full_tensor` gathers the copies and keeps one per head: the original (K*D, C) weight.
A bias (Qwen2's k_proj and v_proj have one) is copied and summed over its copies the same way.

Run: `pytest tests/tensor_parallel -k "tensor_parallel and kv_heads"`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tinyscale.dist import comm
from tinyscale.tensor_parallel.comm_ops import all_gather_dim


class _SumOverCopies(torch.autograd.Function):
    """Forward identity on this rank's copy of head `head`; backward sums the copies' gradients."""

    @staticmethod
    def forward(ctx, weight, head, n_heads, group):
        ctx.head, ctx.n_heads, ctx.group = head, n_heads, group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        buf = grad.new_zeros((ctx.n_heads, *grad.shape))  # (K, D, C): this rank's partial at its head
        buf[ctx.head] = grad
        comm.all_reduce(buf, group=ctx.group)
        return buf[ctx.head], None, None, None


class ReplicatedKVLinear(nn.Module):
    """wk or wv with its K heads replicated over t ranks (t % K == 0): (..., C) -> (..., D); a bias too."""

    def __init__(self, linear: nn.Linear, n_kv_head: int, group) -> None:
        super().__init__()
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        if tp % n_kv_head != 0:
            raise ValueError(f"ReplicatedKVLinear: needs tp={tp} a multiple of n_kv_head={n_kv_head}")
        head_dim = linear.out_features // n_kv_head
        self.group, self.n_kv_head, self.head_dim, self.in_features = group, n_kv_head, head_dim, linear.in_features
        self.head = rank // (tp // n_kv_head)  # the K/V head this rank's query heads read
        rows = linear.weight.detach()[self.head * head_dim:(self.head + 1) * head_dim]
        self.weight = nn.Parameter(rows.clone(), requires_grad=linear.weight.requires_grad)  # (D, C)
        self.bias = None
        if linear.bias is not None:
            head_bias = linear.bias.detach()[self.head * head_dim:(self.head + 1) * head_dim]
            self.bias = nn.Parameter(head_bias.clone(), requires_grad=linear.bias.requires_grad)  # (D,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _SumOverCopies.apply(self.weight, self.head, self.n_kv_head, self.group)
        bias = None if self.bias is None else _SumOverCopies.apply(self.bias, self.head, self.n_kv_head, self.group)
        return F.linear(x, weight, bias)

    def full_tensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        copies = all_gather_dim(local.detach(), 0, self.group)  # (t*D, C) or (t*D,): t/K copies of each head
        tp = dist.get_world_size(self.group)
        per_head = copies.view(tp, self.head_dim, *local.shape[1:])[:: tp // self.n_kv_head]  # (K, D, C)
        return per_head.reshape(self.n_kv_head * self.head_dim, *local.shape[1:])

    def extra_repr(self) -> str:
        return f"in={self.in_features}, head {self.head} of {self.n_kv_head} (replicated), head_dim={self.head_dim}"
