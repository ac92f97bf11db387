"""Shared by the ring attention and Ulysses tests: one attention problem, solved densely in
one process (PyTorch's SDPA, autograd) and sharded over the ranks of a pool."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tinyscale.context_parallel.ring import ring_attention
from tinyscale.context_parallel.sharding import Layout, shard, unshard
from tinyscale.context_parallel.ulysses import ulysses_attention
from tinyscale.dist import comm

D = 8  # head dim


def problem(T, H, K, seed, B=2, dtype=torch.float64):
    """q (B, H, T, D), k, v (B, K, T, D), and an upstream gradient like q."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k, v = torch.randn(B, K, T, D, generator=g, dtype=dtype), torch.randn(B, K, T, D, generator=g, dtype=dtype)
    return q, k, v, torch.randn(B, H, T, D, generator=g, dtype=dtype)


def dense(T, H, K, seed, causal, rounded_to=torch.float64):
    """[out, lse, dq, dk, dv] of attention over the whole sequence, by SDPA and autograd, in
    float64 on the problem's values rounded to `rounded_to` (what a low-precision run sees)."""
    q, k, v, dout = (t.to(rounded_to).double() for t in problem(T, H, K, seed))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    G = H // K
    mask = torch.ones(T, T, dtype=torch.bool)
    if causal:
        mask = mask.tril()
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=mask)
    (out * dout).sum().backward()
    scores = (q @ k.repeat_interleave(G, 1).transpose(-2, -1)) * D ** -0.5  # (B, H, T, T)
    lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), -1)  # (B, H, T)
    return [out.detach(), lse.detach(), q.grad, k.grad, v.grad]


def sharded_body(algorithm, T, H, K, seed, sharding, causal, dtype=torch.float64, groups=None):
    """On each rank: its shard of the problem through ring/Ulysses, forward and backward.
    Returns [out, lse (ring only, else None), dq, dk, dv] local shards and the ledger rows of
    the forward and of the backward as (op, bytes) lists. `groups` (lists of global ranks,
    covering every rank): run in this rank's group instead of the whole world."""
    group = None
    if groups is not None:
        made = [dist.new_group(ranks) for ranks in groups]  # every rank creates every group, in order
        group = next(g for g, ranks in zip(made, groups) if dist.get_rank() in ranks)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    layout = Layout(cp, sharding, T)
    q, k, v, dout = (shard(t.to(dtype), layout, rank, dim=2) for t in problem(T, H, K, seed))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with comm.record() as fwd:
        if algorithm == "ring":
            out, lse = ring_attention(q, k, v, group, layout=layout, causal=causal)
        else:
            out, lse = ulysses_attention(q, k, v, group, layout=layout, causal=causal), None
    with comm.record() as bwd:
        (out * dout).sum().backward()
    rows = lambda ledger: [(r.op, r.bytes) for r in ledger.rows]  # noqa: E731
    return [out.detach(), lse, q.grad, k.grad, v.grad], rows(fwd), rows(bwd)


def gathered(results, T, sharding):
    """Per-rank [out, lse, dq, dk, dv] -> the full-sequence tensors (padding dropped)."""
    layout = Layout(len(results), sharding, T)
    full = []
    for i in range(5):
        pieces = [r[0][i] for r in results]
        full.append(None if pieces[0] is None else unshard(pieces, layout, dim=2))
    return full
