"""Sequence sharding for context parallelism: which positions each rank holds, and which
(query, key) pairs of a causal mask each rank must compute.

Two layouts of one sequence over `cp` ranks:

- contiguous: `cp` chunks, rank i holds chunk i. Under a causal mask rank i's queries see
  i+1 chunks of keys, so the last rank does ~2cp-1 times the work of the first.
- zigzag: `2 cp` chunks, rank i holds chunks i and 2cp-1-i (Brandon et al., "Striped
  Attention", and the zigzag layout of ring-flash-attention / Llama 3, sec. 3.3.2): an
  early chunk paired with a late one, so every rank does the same causal work.

A length that is not a multiple of the chunk count is padded at the end. Padding sits after
every real token, so a causal mask already hides it from real queries; `Layout.valid` masks
it out of the loss (and, with `key_valid`, out of non-causal attention).

Shape legend: T sequence length (real tokens), P padded length (a multiple of the chunk
count), L chunk length = P / num_chunks, Tl local (per-rank) length = P / cp.
Lesson: lessons/09-context-parallel.md. Tests: `pytest tests/context_parallel -k zigzag`.
"""

from __future__ import annotations

import dataclasses

import torch

SHARDINGS = ("zigzag", "contiguous")
# Targets at padded positions: F.cross_entropy's default ignore_index, so they add no loss.
IGNORE_INDEX = -100


def check_sharding(sharding: str) -> None:
    if sharding not in SHARDINGS:
        raise ValueError(f"context-parallel sharding={sharding!r} is unknown: use one of {SHARDINGS}")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A sequence of `seq_len` real tokens laid out over `cp` ranks by `sharding`."""

    cp: int
    sharding: str
    seq_len: int

    def __post_init__(self) -> None:
        check_sharding(self.sharding)
        for name in ("cp", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Layout.{name}={value!r} is invalid: it must be a positive int")

    @property
    def num_chunks(self) -> int:
        return 2 * self.cp if self.sharding == "zigzag" else self.cp

    @property
    def padded_len(self) -> int:  # P: seq_len rounded up to a multiple of num_chunks
        return -(-self.seq_len // self.num_chunks) * self.num_chunks

    @property
    def chunk_len(self) -> int:  # L
        return self.padded_len // self.num_chunks

    @property
    def local_len(self) -> int:  # Tl
        return self.padded_len // self.cp

    def chunks(self, rank: int) -> tuple[int, ...]:
        """Global chunk ids rank `rank` holds, in local order (ascending)."""
        if not 0 <= rank < self.cp:
            raise ValueError(f"rank {rank} is outside the context-parallel group of size {self.cp}")
        if self.sharding == "zigzag":
            return (rank, 2 * self.cp - 1 - rank)
        return (rank,)

    def positions(self, rank: int) -> torch.Tensor:
        """(Tl,) int64: the global position of each local token (RoPE reads these)."""
        L = self.chunk_len
        return torch.cat([torch.arange(c * L, (c + 1) * L) for c in self.chunks(rank)])

    def valid(self, rank: int) -> torch.Tensor:
        """(Tl,) bool: True at real tokens, False at padding."""
        return self.positions(rank) < self.seq_len


def shard(x: torch.Tensor, layout: Layout, rank: int, *, dim: int = 1, pad_value=0) -> torch.Tensor:
    """Rank `rank`'s piece of `x` along `dim` (length T there), padded with `pad_value` to P."""
    if x.shape[dim] != layout.seq_len:
        raise ValueError(f"shard: x has length {x.shape[dim]} along dim {dim} but the layout's "
                         f"seq_len is {layout.seq_len}")
    pad_shape = list(x.shape)
    pad_shape[dim] = layout.padded_len - layout.seq_len
    padded = torch.cat([x, x.new_full(pad_shape, pad_value)], dim=dim)  # (..., P, ...)
    return padded.index_select(dim, layout.positions(rank).to(x.device))  # (..., Tl, ...)


def unshard(shards: list[torch.Tensor], layout: Layout, *, dim: int = 1) -> torch.Tensor:
    """Inverse of `shard`: every rank's piece (rank order) -> the sequence, padding dropped."""
    if len(shards) != layout.cp:
        raise ValueError(f"unshard: got {len(shards)} shards for a layout over cp={layout.cp} ranks")
    gathered = torch.cat(shards, dim=dim)  # (..., P, ...) in shard order
    positions = torch.cat([layout.positions(r) for r in range(layout.cp)])  # (P,)
    order = torch.argsort(positions).to(gathered.device)  # global position -> index in shard order
    return gathered.index_select(dim, order).narrow(dim, 0, layout.seq_len)  # (..., T, ...)


# --8<-- [start:block-plan]
def block_plan(layout: Layout, q_rank: int, kv_rank: int, *, causal: bool) -> list[tuple[slice, slice, str]]:
    """The attention blocks rank `q_rank` computes against rank `kv_rank`'s keys.

    Each entry is (query slice, key slice, mask kind) in local indices; kind is "full" (every
    pair unmasked) or "causal" (a diagonal chunk: key j visible to query i iff j <= i).
    Chunk pairs whose keys all lie in the queries' future are skipped: no work, no entry.
    """
    Tl, L = layout.local_len, layout.chunk_len
    if not causal:
        return [(slice(0, Tl), slice(0, Tl), "full")]
    plan = []
    kv_chunks = layout.chunks(kv_rank)
    for qi, a in enumerate(layout.chunks(q_rank)):
        rows = slice(qi * L, (qi + 1) * L)
        past = [ki for ki, b in enumerate(kv_chunks) if b < a]  # local key chunks wholly in the past
        start = 0
        while start < len(past):  # one "full" block per run of adjacent local chunks
            stop = start
            while stop + 1 < len(past) and past[stop + 1] == past[stop] + 1:
                stop += 1
            plan.append((rows, slice(past[start] * L, (past[stop] + 1) * L), "full"))
            start = stop + 1
        plan += [(rows, slice(ki * L, (ki + 1) * L), "causal") for ki, b in enumerate(kv_chunks) if b == a]
    return plan
# --8<-- [end:block-plan]


def plan_work(layout: Layout, rank: int, *, causal: bool = True) -> int:
    """(q, k) pairs rank `rank` computes over one ring pass (padding included): its cost."""
    work = 0
    for src in range(layout.cp):
        for rows, cols, kind in block_plan(layout, rank, src, causal=causal):
            n = rows.stop - rows.start
            work += n * (n + 1) // 2 if kind == "causal" else n * (cols.stop - cols.start)
    return work


def attention_work(layout: Layout, *, causal: bool = True) -> list[int]:
    """Per rank: the unmasked (query, key) pairs among real tokens, from the mask itself.

    Causal: a real query at position p sees p + 1 keys; otherwise every one of the T keys."""
    work = []
    for rank in range(layout.cp):
        pos = layout.positions(rank)
        pos = pos[pos < layout.seq_len]
        work.append(int((pos + 1).sum()) if causal else int(pos.numel()) * layout.seq_len)
    return work
