"""Make the GPT context-parallel: each rank runs the model on its shard of every sequence.

    apply_context_parallel(model, group, algorithm="ring", sharding="zigzag")
    inputs, targets = shard_batch((inputs, targets), group, sharding="zigzag")
    loss = model(inputs, targets)        # the mean over every real token of the full rows
    loss.backward(); reduce_cp_grads(model, group); optimizer.step()

What changes (in place, on the model built identically on every rank):
- every block's attention becomes a `ContextParallelAttention` (its class swapped in place, so
  whatever wraps its `core` later, selective activation checkpointing, still does): its core is
  ring or Ulysses attention over `group`;
- `model.forward` reads RoPE at the shard's global positions (`Layout.positions`), and its
  loss is sum(token losses on this rank) / (real tokens on all ranks), summed over the group
  by an all-reduce (forward: all-reduce, backward: identity). So every rank returns the same
  loss, and each rank's parameter gradients are its tokens' share: their sum over the group
  (`reduce_cp_grads`, or the data-parallel reduction run over dp x cp with SUM over cp) is the
  single-process gradient.

Padding: `shard_batch` pads rows to a multiple of the chunk count, inputs with token 0,
targets with IGNORE_INDEX (no loss, not counted). Padding comes after every real token, so
the causal mask hides it from real queries; the model treats it as ordinary tokens.

Shape legend: B batch rows, T sequence length, Tl local length (padded length / cp), V vocab.
Lesson: lessons/09-context-parallel.md. Tests: `pytest tests/context_parallel -k cp_gpt`.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tinyscale.context_parallel.ring import ring_attention
from tinyscale.context_parallel.sharding import IGNORE_INDEX, Layout, check_sharding, shard
from tinyscale.context_parallel.ulysses import kv_replication, ulysses_attention
from tinyscale.dist import comm
from tinyscale.models.gpt import Attention

ALGORITHMS = ("ring", "ulysses")


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """What `apply_context_parallel` attached to the model (as `model.context_parallel`)."""

    group: object
    algorithm: str
    sharding: str
    token_losses: Callable  # (logits (B, Tl, V), targets (B, Tl)) -> per-token losses (B, Tl)

    @property
    def cp(self) -> int:
        return dist.get_world_size(self.group)

    def layout(self, local_len: int) -> Layout:
        """The layout of a padded sequence whose shards have `local_len` positions."""
        return Layout(self.cp, self.sharding, local_len * self.cp)


class ContextParallelAttention(Attention):
    """Attention whose core runs over the cp group (`cp_state`), on this rank's shard."""

    cp_state: ContextParallel

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, H, Tl, D), k, v (B, K, Tl, D) -> (B, H, Tl, D). Counter dropout of the
        probabilities: the blocks' masks from their global positions."""
        state = self.cp_state
        layout, dropout = state.layout(q.shape[2]), self.probs_dropout(q)
        if state.algorithm == "ring":
            return ring_attention(q, k, v, state.group, layout=layout, causal=True, dropout=dropout)[0]
        return ulysses_attention(q, k, v, state.group, layout=layout, causal=True, dropout=dropout)


@functools.cache
def _context_parallel_class(own: type) -> type:
    """ContextParallelAttention over an attention's own class (itself for the GPT's Attention)."""
    if own is Attention:
        return ContextParallelAttention
    return type(f"ContextParallel{own.__name__}", (ContextParallelAttention, own), {})


class _SumOverRanks(torch.autograd.Function):
    """Forward: all-reduce SUM over the group. Backward: identity (each rank's gradient is
    its own addends' share; the parameter gradients are summed over the group afterwards)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        comm.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy: logits (B, Tl, V), targets (B, Tl) of real ids -> (B, Tl)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten().long(), reduction="none").view_as(targets)


def _cp_forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
    """GPT.forward on a shard: logits (B, Tl, V), or the full rows' mean loss (same on all ranks)."""
    state: ContextParallel = self.context_parallel
    cfg = self.config
    if idx.dim() != 2:
        raise ValueError(f"idx must be a 2-D (B, Tl) shard of token ids, got shape {tuple(idx.shape)}")
    if ((idx < 0) | (idx >= cfg.vocab_size)).any():
        raise ValueError(f"idx has token ids outside 0..{cfg.vocab_size - 1}: fix the data or vocab_size")
    layout = state.layout(idx.shape[1])
    # Real tokens number more than padded_len - num_chunks: beyond that, too long for sure.
    if layout.padded_len - layout.num_chunks + 1 > cfg.max_seq_len:
        raise ValueError(f"a shard of {idx.shape[1]} positions on cp={state.cp} ranks holds sequences longer "
                         f"than max_seq_len={cfg.max_seq_len}: crop the input or raise GPTConfig.max_seq_len")
    # --8<-- [start:rope]
    # Padded positions may run past the RoPE table: their rows never reach a real token.
    global_positions = layout.positions(dist.get_rank(state.group)).to(idx.device)  # (Tl,)
    positions = global_positions.clamp(max=cfg.max_seq_len - 1)
    cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # (Tl, D) at the global positions
    # --8<-- [end:rope]
    self.dropout_clock.positions = global_positions  # counter dropout: the residual masks' token positions
    x = self.embed(idx)  # (B, Tl, C)
    for block in self.blocks:
        x = block(x, cos, sin)  # (B, Tl, C)
    logits = self.head(self.norm(x))  # (B, Tl, V)
    if targets is None:
        return logits
    if targets.shape != idx.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} != idx shape {tuple(idx.shape)}")
    real = targets != IGNORE_INDEX  # (B, Tl)
    if ((targets[real] < 0) | (targets[real] >= cfg.vocab_size)).any():
        raise ValueError(f"targets has ids outside 0..{cfg.vocab_size - 1} (padding is {IGNORE_INDEX})")
    return sharded_mean_loss(state, logits, targets)


def sharded_mean_loss(state: ContextParallel, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The full rows' mean loss from this rank's shard: logits (B, Tl, V) (or a vocab slice, as
    `state.token_losses` takes), targets (B, Tl) padded with IGNORE_INDEX; the same on every rank."""
    real = targets != IGNORE_INDEX  # (B, Tl)
    # Padding's targets become id 0 for the loss function, and its losses (and gradients) 0 here.
    losses = state.token_losses(logits, targets.masked_fill(~real, 0))  # (B, Tl)
    loss_sum = losses.masked_fill(~real, 0.0).sum()
    totals = _SumOverRanks.apply(torch.stack([loss_sum, real.sum().to(loss_sum.dtype)]), state.group)
    return totals[0] / totals[1]  # sum of every rank's token losses / every rank's real tokens


# --8<-- [start:apply]
def apply_context_parallel(model: torch.nn.Module, group=None, *, algorithm: str = "ring",
                           sharding: str = "zigzag", token_losses: Callable = token_cross_entropy) -> torch.nn.Module:
    """Swap the GPT's attention core and forward for context parallelism over `group`, in place.
    `token_losses(logits, targets)`: per-token losses of the head's output (default cross-entropy;
    a tensor-parallel head needs the vocab-parallel one)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"context-parallel algorithm={algorithm!r} is unknown: use one of {ALGORITHMS}")
    check_sharding(sharding)
    if not hasattr(model, "blocks") or not hasattr(model, "rope_cos"):
        raise TypeError(f"apply_context_parallel expects a tinyscale GPT, got {type(model).__name__}")
    if getattr(model, "context_parallel", None) is not None:
        raise ValueError("apply_context_parallel: the model is context-parallel already")
    if model.config.dropout > 0 and model.config.dropout_masks != "counter":
        raise ValueError(f"context parallelism does not support dropout={model.config.dropout} with stream masks "
                         "(each rank would need the stream's draws for the keys it does not hold): set "
                         "GPTConfig.dropout_masks='counter', or dropout=0")
    state = ContextParallel(group, algorithm, sharding, token_losses)
    parallelize_attention(model.blocks, state)
    model.context_parallel = state
    model.forward = types.MethodType(_cp_forward, model)
    return model
# --8<-- [end:apply]


def parallelize_attention(blocks, state: ContextParallel) -> None:
    """Swap each block's attention core for ring or Ulysses attention over `state.group`, in
    place (the per-block part of `apply_context_parallel`; a pipeline stage's blocks alone too)."""
    for block in blocks:
        attn = block.attn
        if state.algorithm == "ulysses":  # head counts from the weights: a tensor-parallel shard has fewer
            kv_replication(attn.wq.weight.shape[0] // attn.head_dim, attn.wk.weight.shape[0] // attn.head_dim,
                           state.cp)  # raises on heads % cp != 0
        attn.cp_state = state
        attn.__class__ = _context_parallel_class(type(attn))


def shard_batch(batch, group=None, sharding: str = "zigzag") -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (B, T) -> this rank's (B, Tl) shards; padding: token 0 in
    inputs, IGNORE_INDEX in targets."""
    inputs, targets = batch
    if inputs.dim() != 2 or inputs.shape != targets.shape:
        raise ValueError(f"shard_batch: inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} "
                         "must both be (B, T)")
    layout = Layout(dist.get_world_size(group), sharding, inputs.shape[1])
    rank = dist.get_rank(group)
    return (shard(inputs, layout, rank, dim=1, pad_value=0),
            shard(targets, layout, rank, dim=1, pad_value=IGNORE_INDEX))


def reduce_cp_grads(model: torch.nn.Module, group=None) -> None:
    """Sum every parameter's gradient over the context-parallel group (in place). Every rank
    must hold the same set of gradients (true for the GPT: all its parameters are used on
    every shard); the engine folds this into its data-parallel reduction instead."""
    for param in model.parameters():
        if param.grad is not None:
            comm.all_reduce(param.grad, group=group)
