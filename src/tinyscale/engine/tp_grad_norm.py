"""Gradient clipping by global norm when the parameters are tensor-parallel shards.

The global norm is that of the full model's gradient. A split parameter's gradient is spread
over the TP group (each rank holds its shard's), so its squared norm is summed over the group;
a replicated one (norm weights: identical gradients on every TP rank, f all-reduces them) is
counted once. Then every rank scales by the same factor, torch's `clip_grad_norm_` rule:
min(1, max_norm / (norm + 1e-6)). Megatron's `clip_grad_norm_fp32` does the same sum.
Run: `pytest tests/engine/test_engine_tensor_parallel.py -k clip`.
"""

from __future__ import annotations

import torch
from torch import nn

from tinyscale.dist import comm
from tinyscale.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


def split_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters that hold a shard (the rest are replicated over the TP group)."""
    split = set()
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            split.update(id(p) for p in module.parameters(recurse=False))
        elif isinstance(module, RowParallelLinear):  # its bias is replicated
            split.add(id(module.weight))
    return split


@torch.no_grad()
def clip_grad_norm_tp(params: list[torch.Tensor], split: set[int], max_norm: float, group) -> torch.Tensor:
    """Scale the gradients of `params` so the full model's gradient norm is at most `max_norm`;
    returns that norm (the same on every rank of the TP group)."""
    grads = [(id(p), p.grad) for p in params if p.grad is not None]
    dtype = grads[0][1].dtype if grads else torch.float32
    device = grads[0][1].device if grads else torch.device("cpu")
    sharded = torch.zeros((), dtype=dtype, device=device)
    replicated = torch.zeros((), dtype=dtype, device=device)
    for pid, g in grads:
        if pid in split:
            sharded += g.pow(2).sum()
        else:
            replicated += g.pow(2).sum()
    comm.all_reduce(sharded, group=group)  # the shards' squares, over the TP group
    norm = (sharded + replicated).sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for _, g in grads:
        g.mul_(scale)
    return norm
