"""DeepSpeed-Ulysses: trade the sequence shard for a head shard, attend locally, trade back.

Jacobs et al., "DeepSpeed Ulysses" (2023), sec. 3. Each of the cp ranks holds Tl = P / cp
positions of every head. One all-to-all per tensor gives each rank every position of
H / cp heads; attention is then ordinary full-sequence attention on those heads (no ring, no
merge); a last all-to-all brings the output back to the sequence shard. Forward: 4
all-to-alls per layer (q, k, v, out); backward: 4 more (their transposes, by autograd).

Heads must divide: H % cp != 0 raises ValueError. GQA: the K K/V heads are split across
ranks when K % cp == 0. Otherwise each K/V head is replicated r = lcm(K, cp) / K times
before the all-to-all (r consecutive copies, so query head h still reads copy of h // G):
correct for any K that divides H, at r times the K/V bytes. (DeepSpeed refuses instead.)

The attention itself runs on the fastest exact kernel the device has (`blocks.py`: Triton,
the CPU's flash kernel, or merge.py's block with dropout).

A zigzag layout gathers the sequence in shard order; attention runs on it reordered to
global order (one gather each way, and one each way in backward: `Permute`), so the causal
mask is the plain triangle; a contiguous layout is already in order (no gather).

Shape legend: B batch, H query heads, K key/value heads, Tl local length, P padded length
(= cp * Tl), D head dim. Lesson: lessons/09-context-parallel.md.
Tests: `pytest tests/context_parallel -k ulysses`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from tinyscale.context_parallel.blocks import BlockAttention
from tinyscale.context_parallel.merge import block_attention
from tinyscale.context_parallel.sharding import Layout
from tinyscale.dist import comm
from tinyscale.models.dropout import ProbsDropout


# --8<-- [start:all-to-all]
def _seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """(B, N, Tl, D) sequence shard of N heads -> (B, N/cp, P, D): all positions of N/cp heads."""
    cp = dist.get_world_size(group)
    B, N, Tl, D = x.shape
    # (cp, B, N/cp, Tl, D): head group j goes to rank j
    send = x.reshape(B, cp, N // cp, Tl, D).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group=group)  # recv[i]: rank i's positions of my head group
    return recv.permute(1, 2, 0, 3, 4).reshape(B, N // cp, cp * Tl, D)  # (B, N/cp, cp, Tl, D) -> (B, N/cp, P, D)


def _head_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, N/cp, P, D) -> (B, N, Tl, D): the inverse of `_seq_to_head`."""
    cp = dist.get_world_size(group)
    B, Nl, P, D = x.shape
    # (cp, B, N/cp, Tl, D): positions of shard j go to rank j
    send = x.reshape(B, Nl, cp, P // cp, D).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group=group)  # recv[i]: head group i of my positions
    return recv.transpose(0, 1).reshape(B, cp * Nl, P // cp, D)  # (B, cp, N/cp, Tl, D) -> (B, N, Tl, D)


class SeqToHead(torch.autograd.Function):
    """Forward: all-to-all sequence shard -> head shard. Backward: all-to-all head -> sequence."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _head_to_seq(grad.contiguous(), ctx.group), None


class HeadToSeq(torch.autograd.Function):
    """Forward: all-to-all head shard -> sequence shard. Backward: all-to-all sequence -> head."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _head_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_head(grad.contiguous(), ctx.group), None
# --8<-- [end:all-to-all]


class Permute(torch.autograd.Function):
    """x.index_select(dim, index) for a permutation `index` of that dim; the gradient is the
    inverse permutation's gather (`inverse`), one copy, where autograd's own for index_select
    is a zero-filled buffer and an index_add."""

    @staticmethod
    def forward(ctx, x, index, inverse, dim: int):
        ctx.inverse, ctx.dim = inverse, dim
        return x.index_select(dim, index)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(ctx.dim, ctx.inverse), None, None, None


def kv_replication(n_head: int, n_kv_head: int, cp: int) -> int:
    """How many copies of each K/V head travel, so that cp divides the K/V heads (1: none)."""
    if n_head % cp:
        raise ValueError(f"Ulysses needs the query heads divisible by the context-parallel size: "
                         f"n_head={n_head} % cp={cp} = {n_head % cp}; use a cp that divides {n_head}, "
                         "or ring attention (any head count)")
    if n_head % n_kv_head:
        raise ValueError(f"n_head={n_head} is not a multiple of n_kv_head={n_kv_head}")
    return math.lcm(n_kv_head, cp) // n_kv_head


# --8<-- [start:ulysses]
def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, layout: Layout,
                      causal: bool = True, scale: float | None = None,
                      dropout: ProbsDropout | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, by head-sharding.
    q (B, H, Tl, D), k, v (B, K, Tl, D), this rank's shard under `layout` -> out (B, H, Tl, D).
    Padded keys (positions >= layout.seq_len) are masked out. dropout: counter dropout of the
    probabilities (`tinyscale.models.dropout`), for this rank's H/cp heads at positions 0..P-1."""
    cp = dist.get_world_size(group)
    if layout.cp != cp:
        raise ValueError(f"ulysses_attention: layout is for cp={layout.cp} but the group has {cp} ranks")
    copies = kv_replication(q.shape[1], k.shape[1], cp)
    if copies > 1:  # too few K/V heads to split: replicate each (autograd sums the copies' grads)
        k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)  # (B, K*copies, Tl, D)
    qh, kh, vh = (SeqToHead.apply(t, group) for t in (q, k, v))  # (B, H/cp | K'/cp, P, D), shard order
    shard_order = torch.cat([layout.positions(r) for r in range(cp)]).to(q.device)  # (P,) position of each row
    to_global = torch.argsort(shard_order)  # global position p is at row to_global[p]
    reorder = not bool((shard_order == torch.arange(len(shard_order), device=q.device)).all())  # contiguous: no
    if reorder:
        qh, kh, vh = (Permute.apply(t, to_global, shard_order, 2) for t in (qh, kh, vh))  # (B, N, P, D) by position
    key_valid = None
    if layout.padded_len != layout.seq_len:
        key_valid = torch.arange(layout.padded_len, device=q.device) < layout.seq_len
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dropout_scale = None
    if dropout is not None:  # this rank holds head group `rank` of the H heads (`_seq_to_head`)
        dropout = dropout.with_heads(dropout.heads.chunk(cp)[dist.get_rank(group)])
        positions = torch.arange(layout.padded_len, device=q.device)
        dropout_scale = dropout.scale(positions, positions, torch.promote_types(q.dtype, torch.float32))
    kind = "causal" if causal else "full"
    if dropout_scale is None:  # the fastest exact kernel here (blocks.py), its backward hand-written
        out, _ = BlockAttention.apply(qh, kh, vh, kind, scale, key_valid)  # (B, H/cp, P, D)
    else:  # counter dropout: merge.py's block, differentiated by autograd
        out, _ = block_attention(qh, kh, vh, causal_mask_kind=kind, scale=scale, key_valid=key_valid,
                                 dropout_scale=dropout_scale)
    if reorder:
        out = Permute.apply(out, shard_order, to_global, 2)  # back to shard order
    return HeadToSeq.apply(out, group)  # -> (B, H, Tl, D)
# --8<-- [end:ulysses]
