"""Gradient clipping by global norm when the parameters are tensor-parallel shards.

The global norm is that of the full model's gradient. A split parameter's gradient is spread
over the TP group (each rank holds its shard's), so every rank counts its shard; a replicated
one (norm weights: identical gradients on every TP rank, f all-reduces them) is counted by TP
rank 0 only, and a K/V head copied on t/K ranks (`ReplicatedKVLinear`: the copies' gradients
are summed, so equal) by its first copy only. One all-reduce sums the counted squares: over
the TP group at ZeRO stage 0 (the dp replicas hold the same gradients), over the whole world
at stages 1-3 (each dp rank holds a shard of this TP rank's gradients). Then every rank
scales by the same factor, torch's `clip_grad_norm_` rule: min(1, max_norm / (norm + 1e-6)).
Megatron's `clip_grad_norm_fp32` does the same sum. Under mixed precision the same sum runs
on the fp32 masters' unscaled gradients (stage 0: `parallelize.mixed_precision_clipper`).
Run: `pytest tests/engine/test_engine_tensor_parallel.py -k clip`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from tinyscale.dist import comm
from tinyscale.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tinyscale.tensor_parallel.kv_heads import ReplicatedKVLinear


def counted_parameters(model: nn.Module, group) -> set[int]:
    """ids of the parameters whose gradient this rank counts in the global norm (see above)."""
    tp_rank, tp = dist.get_rank(group), dist.get_world_size(group)
    counted = set()
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            counted.update(id(p) for p in own)
        elif isinstance(module, RowParallelLinear):  # its bias is replicated
            counted.update(id(p) for p in own if p is module.weight or tp_rank == 0)
        elif isinstance(module, ReplicatedKVLinear):  # copies on ranks head*t/K .. (head+1)*t/K - 1
            if tp_rank == module.head * (tp // module.n_kv_head):
                counted.update(id(p) for p in own)
        elif tp_rank == 0:  # replicated: norm weights
            counted.update(id(p) for p in own)
    return counted


def _clip(grads: list[torch.Tensor], squares: torch.Tensor, max_norm: float, group) -> torch.Tensor:
    comm.all_reduce(squares, group=group)  # the counted squares, over the group
    norm = squares.sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return norm


@torch.no_grad()
def clip_grad_norm_tp(params: list[torch.Tensor], counted: set[int], max_norm: float, group) -> torch.Tensor:
    """ZeRO stage 0: scale the gradients of `params` so the full model's gradient norm is at most
    `max_norm`; returns that norm (the same on every rank of the TP group `group`)."""
    grads = [p.grad for p in params if p.grad is not None]
    dtype = grads[0].dtype if grads else torch.float32
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), dtype=dtype, device=device)
    for p in params:
        if p.grad is not None and id(p) in counted:
            squares += p.grad.pow(2).sum()
    return _clip(grads, squares, max_norm, group)


def sharded_clipper(sharded, counted: set[int], group=None) -> Callable[[float], float]:
    """ZeRO stages 1-3: a `clip_grad_norm_(max_norm)` for the `ShardedOptimizer` `sharded`, whose
    gradient shards hold this dp rank's part of this TP rank's gradients: each parameter
    fragment counted as its parameter is, summed over `group` (None: the world, dp x tp)."""
    @torch.no_grad()
    def clip_grad_norm_(max_norm: float) -> float:
        squares = torch.zeros((), dtype=torch.float64, device=sharded.units[0].device)
        for g, fragments in zip(sharded.grad, sharded.fragments):
            for f in fragments if g is not None else ():
                if id(f.param) in counted:
                    squares += g[f.start:f.end].double().pow(2).sum()
        return _clip([g for g in sharded.grad if g is not None], squares, max_norm, group).item()
    return clip_grad_norm_
