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

Both modes need the shared stream equal on every rank of the TP group (`share_stream`), or the
copies of a replicated activation drift apart. The exact mode over data-parallel ranks too: each
dp rank draws the masks of the micro-batches before and after its own (`skip_exact_masks`), as one
process draws the whole global batch's, so the engine's dp x tp run equals one process.

Under activation checkpointing a recomputation must draw the forward's masks again: torch's
checkpoint replays the global generators only, so the engine hands the tracker's generator to the
policy (`apply_policy(..., generators=[tracker.generator])`), which replays it the same way.

Run: `pytest tests/tensor_parallel -k "tensor_parallel and dropout"`.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tinyscale.dist import comm
from tinyscale.models.gpt import Attention, Block, causal_attention

TRACKER_SEED_OFFSET = 2718  # Megatron's offset between the shared seed and the per-rank seeds


class RNGTracker:
    """This rank's own stream for dropout on sharded activations (Megatron's 'model-parallel-rng')."""

    def __init__(self, seed: int, tp_rank: int, device) -> None:
        self.seed = seed + TRACKER_SEED_OFFSET + tp_rank
        self.generator = torch.Generator(device=device).manual_seed(self.seed)

    def get_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


def share_stream(group, src: int, device: torch.device) -> int:
    """Make the shared stream (the global generators) on every rank of `group` equal to global
    rank `src`'s; returns a seed derived from it (for the tracker) without drawing from it."""
    states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])
    for state in states:  # (N,) uint8 generator states
        on_device = state.to(device)
        comm.broadcast(on_device, src=src, group=group)
        state.copy_(on_device.cpu())
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
    digest = hashlib.sha256(states[0].numpy().tobytes()).digest()
    return int.from_bytes(digest[:8], "little") >> 2  # room for the offset and tp rank below 2**64


def exact_mask_shapes(model, rows: int, seq_len: int) -> list[tuple[int, ...]]:
    """The dropout masks one process draws in one training forward of the GPT on (rows, seq_len)
    ids, in order: per block the attention probabilities (rows, H, T, T), then the two residual
    branches (rows, T, C)."""
    cfg = model.config
    block_masks = [(rows, cfg.n_head, seq_len, seq_len), (rows, seq_len, cfg.d_model), (rows, seq_len, cfg.d_model)]
    return [shape for block in model.blocks if block.dropout > 0 for shape in block_masks]


@torch.no_grad()
def skip_exact_masks(model, rows: int, seq_len: int, forwards: int) -> None:
    """Advance the shared stream past `forwards` forwards' masks by drawing them (and dropping them):
    the micro-batches of the other dp ranks, which one process draws before or after this rank's."""
    ref = model.embed.weight
    for _ in range(forwards):
        for shape in exact_mask_shapes(model, rows, seq_len):
            F.dropout(torch.ones(shape, dtype=ref.dtype, device=ref.device), model.config.dropout)


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
