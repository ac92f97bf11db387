"""Dropout under tensor parallelism: Megatron's RNG tracker, and an exact mode for the tests.

Where the GPT drops (`models/gpt.py`): the attention probabilities (B, H, T, T), split by heads
over the TP group, inside the region; and both residual branches (B, T, C), replicated outside
the region, or split along the sequence under sequence parallelism.

- tracker mode (Megatron-LM's `random.py`, `model_parallel_cuda_manual_seed`): a sharded
  activation is dropped from this rank's own stream, seeded by seed + 2718 + tp_rank, so the
  shards get independent masks; a replicated one from the shared stream (the global RNG, seeded
  alike on every TP rank), so every rank drops the same elements and the copies stay equal. Each
  rank draws 1/t of the mask: no extra work, but the masks differ from one process's.
- exact mode (`exact_dropout=True`): every rank draws the mask of the FULL tensor from the shared
  stream, as one process would, and keeps its slice, so training equals one process bit for bit.
  Each rank generates t times the random numbers (and holds a full mask for a moment).

Run: `pytest tests/tensor_parallel -k "tensor_parallel and dropout"`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tinyscale.models.gpt import Attention, Block, causal_attention

TRACKER_SEED_OFFSET = 2718  # Megatron's offset between the shared seed and the per-rank seeds


class RNGTracker:
    """This rank's own stream for dropout on sharded activations (Megatron's 'model-parallel-rng')."""

    def __init__(self, seed: int, tp_rank: int, device) -> None:
        self.seed = seed + TRACKER_SEED_OFFSET + tp_rank
        self.generator = torch.Generator(device=device).manual_seed(self.seed)


# --8<-- [start:dropout]
class TensorParallelDropout(nn.Module):
    """Dropout with probability p of an activation split along `dim` over `group` (dim=None:
    replicated, every rank the same mask from the shared stream)."""

    def __init__(self, p: float, group, *, dim: int | None, exact: bool, tracker: RNGTracker) -> None:
        super().__init__()
        self.p, self.group, self.dim, self.exact, self.tracker = p, group, dim, exact, tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.dim is None:  # replicated: the shared stream, as one process draws it
            return F.dropout(x, self.p)
        tp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if self.exact:  # the full tensor's mask from the shared stream; keep this rank's slice
            full = list(x.shape)
            full[self.dim] *= tp
            scale = F.dropout(torch.ones(full, dtype=x.dtype, device=x.device), self.p)  # 0 or 1/(1-p)
            return x * scale.chunk(tp, dim=self.dim)[rank]
        keep = torch.empty_like(x).bernoulli_(1 - self.p, generator=self.tracker.generator)  # own stream
        return x * keep.div_(1 - self.p)
# --8<-- [end:dropout]

    def extra_repr(self) -> str:
        return f"p={self.p}, dim={self.dim}, exact={self.exact}"


class TensorParallelAttention(Attention):
    """Attention whose core drops the probabilities of this rank's heads through `attn_drop`."""

    attn_drop: TensorParallelDropout

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout == 0:
            return super().core(q, k, v)
        return causal_attention(q, k, v, impl=self.impl, dropout_fn=self.attn_drop)  # (B, H/t, T, D)


class TensorParallelBlock(Block):
    """A block whose residual dropouts know whether x is replicated or a sequence shard."""

    resid_drop: TensorParallelDropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_drop(self.attn(self.attn_norm(x), cos, sin))
        return x + self.resid_drop(self.mlp(self.mlp_norm(x)))


def add_tensor_parallel_dropout(block: Block, group, *, sequence_parallel: bool, exact: bool,
                                tracker: RNGTracker) -> None:
    """Give a split block its dropouts, in place: heads are dim 1 of the (B, H/t, T, T)
    probabilities; the residual branches are replicated, or split on dim 1 (T) under SP."""
    p = block.dropout
    block.attn.attn_drop = TensorParallelDropout(p, group, dim=1, exact=exact, tracker=tracker)
    block.resid_drop = TensorParallelDropout(p, group, dim=1 if sequence_parallel else None, exact=exact,
                                             tracker=tracker)
    block.attn.__class__, block.__class__ = TensorParallelAttention, TensorParallelBlock
