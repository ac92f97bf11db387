"""Ring attention: each rank keeps its queries and passes K/V blocks around the ring.

Liu et al., "Ring Attention with Blockwise Transformers" (2023), sec. 3; the backward as in
ring-flash-attention. With the sequence sharded over `cp` ranks (`sharding.Layout`):

forward   cp steps. At step s rank r holds the K/V block of rank r - s. It posts the send of
          that block to r + 1 and the receive of the next from r - 1, computes attention of its
          queries on the block it holds meanwhile (the overlap), and merges the result into
          its running (out, lse) with the log-sum-exp rule (`merge.py`). cp - 1 hops.
backward  a second ring pass. K/V travel again; with them travels, one step behind, an
          accumulator of dK/dV for the block's owner: at step s >= 1 rank r adds its
          contribution to the accumulator of owner r - s that rank r - 1 sent it, and sends
          it on; after step cp - 1 it lands at its owner, which adds its own block's share.
          Each rank recomputes block probabilities from its saved q and merged lse.

Dropout on the probabilities (counter masks only): each block's mask is a function of its
queries' and keys' global positions (`_block_dropout`), dropped after the block's softmax,
its lse undropped, as FlashAttention does; the merge then equals dropout after the full
softmax, and the backward redraws the same masks. Such blocks use merge.py's path.

Causal masks come from `sharding.block_plan`: blocks wholly in the future are skipped,
blocks wholly in the past are "full", a chunk against itself is "causal". GQA: K/V travel
with their K heads only; the block kernel groups the H query heads onto them. Each block
runs on the fastest exact kernel the device has (`blocks.py`): Triton where it runs, else
the CPU's flash kernel (float64, float32, bf16), else merge.py's: the same contract.

Per rank and layer the ledger shows (e = element bytes): forward cp - 1 sends of a packed
K/V block, 2 B Tl K D e bytes each; backward cp - 1 more of K/V and cp - 1 of dK/dV
(accumulated in at least float32: twice the K/V bytes when K/V are bf16).

Shape legend: B batch, H query heads, K key/value heads, Tl local sequence length, D head dim.
Lesson: lessons/09-context-parallel.md. Tests: `pytest tests/context_parallel -k ring_attention`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tinyscale.context_parallel.blocks import attend as _attend
from tinyscale.context_parallel.blocks import attend_backward as _attend_backward
from tinyscale.context_parallel.merge import merge_partials
from tinyscale.context_parallel.sharding import Layout, block_plan
from tinyscale.dist import comm
from tinyscale.models.dropout import ProbsDropout


def _block_dropout(dropout: ProbsDropout | None, layout: Layout, rank: int, src: int, rows: slice, cols: slice,
                   dtype: torch.dtype) -> torch.Tensor | None:
    """The counter mask of one block, (B, H, rows, cols): from the global positions of this rank's
    query rows and rank src's key columns, so no rank needs another's generator."""
    if dropout is None:
        return None
    return dropout.scale(layout.positions(rank)[rows], layout.positions(src)[cols], dtype)


def _ring_peers(group) -> tuple[int, int, int, int]:
    """(cp, this rank in the group, global rank of the next, of the previous)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    glob = lambda r: dist.get_global_rank(group, r) if group is not None else r  # noqa: E731
    return cp, rank, glob((rank + 1) % cp), glob((rank - 1) % cp)


def _pass_on(send: torch.Tensor, nxt: int, prv: int, group) -> tuple[torch.Tensor, list]:
    """Post: send `send` to the next rank, receive a tensor like it from the previous one."""
    recv = torch.empty_like(send)
    works = comm.batch_isend_irecv([comm.P2POp("isend", send, nxt, group), comm.P2POp("irecv", recv, prv, group)])
    return recv, works


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _key_valid(layout: Layout, rank: int) -> torch.Tensor | None:
    return None if layout.padded_len == layout.seq_len else layout.valid(rank)


class RingAttention(torch.autograd.Function):
    """Forward: K/V ring with online-softmax merge. Backward: K/V ring plus dK/dV ring."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout: Layout, causal: bool, scale: float, dropout: ProbsDropout | None):
        cp, rank, nxt, prv = _ring_peers(group)
        B, H, Tl, D = q.shape
        ct = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(B, H, Tl, D, dtype=ct, device=q.device)
        lse = torch.full((B, H, Tl), float("-inf"), dtype=ct, device=q.device)
        kv = torch.stack([k, v]).contiguous()  # (2, B, K, Tl, D): K and V travel as one message
        # --8<-- [start:ring-forward]
        for step in range(cp):
            src = (rank - step) % cp  # whose K/V block this rank holds now
            if step < cp - 1:  # post the next hop first, so it flies while we compute
                next_kv, works = _pass_on(kv, nxt, prv, group)
            valid = _key_valid(layout, src)
            for rows, cols, kind in block_plan(layout, rank, src, causal=causal):
                o, l = _attend(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal_mask_kind=kind,
                               scale=scale, key_valid=None if valid is None else valid[cols],
                               dropout_scale=_block_dropout(dropout, layout, rank, src, rows, cols, ct))
                out[:, :, rows], lse[:, :, rows] = merge_partials(out[:, :, rows], lse[:, :, rows], o.to(ct), l)
            if step < cp - 1:
                _wait(works)
                kv = next_kv
        # --8<-- [end:ring-forward]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout, ctx.causal, ctx.scale, ctx.dropout = group, layout, causal, scale, dropout
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group, layout, causal, scale, dropout = ctx.group, ctx.layout, ctx.causal, ctx.scale, ctx.dropout
        cp, rank, nxt, prv = _ring_peers(group)
        dq = torch.zeros_like(out)  # (B, H, Tl, D) in the compute dtype
        kv = torch.stack([k, v]).contiguous()  # (2, B, K, Tl, D)
        acc, acc_works, sent = None, [], []  # dK/dV accumulator arriving from the previous rank
        # --8<-- [start:ring-backward]
        for step in range(cp):
            src = (rank - step) % cp
            if step < cp - 1:
                next_kv, kv_works = _pass_on(kv, nxt, prv, group)
            dkv = torch.zeros(kv.shape, dtype=out.dtype, device=kv.device)  # (2, B, K, Tl, D)
            valid = _key_valid(layout, src)
            for rows, cols, kind in block_plan(layout, rank, src, causal=causal):
                dq_b, dk_b, dv_b = _attend_backward(
                    dout[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], out[:, :, rows],
                    lse[:, :, rows], causal_mask_kind=kind, scale=scale,
                    key_valid=None if valid is None else valid[cols],
                    dropout_scale=_block_dropout(dropout, layout, rank, src, rows, cols, out.dtype))
                dq[:, :, rows] += dq_b
                dkv[0][:, :, cols] += dk_b
                dkv[1][:, :, cols] += dv_b
            if step == 0:
                own = dkv  # this rank's share of its own block's gradient: it stays here
            else:
                if acc is not None:  # owner src's accumulator from ranks src+1 .. rank-1
                    _wait(acc_works)
                    dkv += acc
                # to rank + 1: the next contributor, or (after the last step) the owner itself
                acc, acc_works = _pass_on(dkv, nxt, prv, group)
                sent.append(dkv)  # keep the buffer alive until its send completes
            if step < cp - 1:
                _wait(kv_works)
                kv = next_kv
        if cp > 1:
            _wait(acc_works)
            own = own + acc  # everyone else's share of this rank's dK/dV
        # --8<-- [end:ring-backward]
        dk, dv = own[0].to(k.dtype), own[1].to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, layout: Layout,
                   causal: bool = True, scale: float | None = None,
                   dropout: ProbsDropout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries over the whole sequence. q (B, H, Tl, D), k, v
    (B, K, Tl, D), each this rank's shard under `layout` -> out (B, H, Tl, D), lse (B, H, Tl)
    (lse is not differentiable). Padded keys (positions >= layout.seq_len) are masked out.
    dropout: counter dropout of the probabilities (`tinyscale.models.dropout`), each block's mask
    from its global (query, key) positions; lse stays that of the undropped softmax."""
    cp = dist.get_world_size(group)
    if layout.cp != cp:
        raise ValueError(f"ring_attention: layout is for cp={layout.cp} but the group has {cp} ranks")
    if q.shape[2] != layout.local_len or k.shape[2] != layout.local_len:
        raise ValueError(f"ring_attention: q has {q.shape[2]} and k {k.shape[2]} local positions but the "
                         f"layout gives each rank {layout.local_len} (padded length {layout.padded_len} / cp {cp})")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} K/V heads")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, group, layout, causal, scale, dropout)
