"""`apply_tensor_parallel`: the GPT made tensor- (and sequence-) parallel in place, and its inverse.

As torchtitan's `apply_tp` plans the Llama (and Megatron-LM lays out its GPT), per block:

    attn_norm   replicated (sequence parallel: on a sequence shard, weight grad all-reduced)
    attn        enter the region once (f, or the sequence all-gather); wq, wk, wv column-parallel
                by heads; the core runs on this rank's heads; wo row-parallel (g, or reduce-scatter)
    mlp_norm    as attn_norm
    mlp         enter the region once; w_gate, w_up column-parallel; w_down row-parallel

and around them: the embedding vocab-parallel (its partial rows summed by g, or reduce-scattered
along the sequence), the final norm replicated, the head column-parallel without gathering, and
the loss `vocab_parallel_cross_entropy` on the local logits. Two all-reduces of (B, T, C) per
block forward and two backward; with sequence parallelism two all-gathers and two reduce-scatters
each way, the same bytes on the wire.

GQA: K/V heads are split like query heads when t divides n_kv_head, each rank keeping the K/V
heads its query heads read; when n_kv_head divides t they are replicated (`kv_heads.py`).
Dropout with stream masks: an RNG tracker, or with exact_dropout=True the full masks of one
process (`random.py`); with counter masks (GPTConfig.dropout_masks) each rank hashes its heads'
and sequence slice's masks from their global coordinates (`models/dropout.py`).
What it refuses (ValueError naming the numbers and the fix): n_head not divisible by t, n_kv_head
neither dividing nor divided by t, ffn hidden size not divisible by t, and a sequence length not
divisible by t under sequence parallelism. A vocab that t does not divide is
padded (`layers.VocabParallelEmbedding`). Tied embedding and head: both are split by vocab rows,
so they share one local shard, one Parameter, as in the single-process model.

The model keeps its state_dict keys (each rank's holds its shards); `full_state_dict_from_tp`
gathers the original, unsharded, unpadded tensors. Run: `pytest tests/tensor_parallel -k tp_gpt`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tinyscale.dist import ParallelMesh
from tinyscale.models.gpt import GPT, Block, SwiGLU, check_ids, compute_dtype
from tinyscale.tensor_parallel.comm_ops import copy_to_region, gather_from_region, gather_from_sequence
from tinyscale.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tinyscale.tensor_parallel.kv_heads import ReplicatedKVLinear
from tinyscale.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelRMSNorm,
    VocabParallelEmbedding,
)
from tinyscale.tensor_parallel.random import RNGTracker, add_tensor_parallel_dropout


def _tp_group(mesh_or_group):
    return mesh_or_group.group("tp") if isinstance(mesh_or_group, ParallelMesh) else mesh_or_group


# --8<-- [start:check]
def check_tensor_parallel(config, tp: int) -> None:
    """Raise ValueError if the GPT `config` cannot be split over `tp` ranks (no processes needed)."""
    rules = [
        ("n_head", config.n_head, "query heads are split whole over the ranks"),
        ("ffn_hidden", config.ffn_dim, "w_gate/w_up rows and w_down columns are split evenly"),
    ]
    for field, value, why in rules:
        if value % tp != 0:
            raise ValueError(f"tensor parallel: GPTConfig.{field} resolves to {value}, not divisible by tp={tp} "
                             f"({why}): choose tp dividing {value}, or change {field}")
    kv = config.kv_heads
    if kv % tp != 0 and tp % kv != 0:
        raise ValueError(f"tensor parallel: GPTConfig.n_kv_head resolves to {kv}, neither divisible by tp={tp} "
                         f"(K/V heads split) nor dividing it (K/V heads replicated): choose n_kv_head a "
                         f"multiple or a divisor of {tp}")
# --8<-- [end:check]


def _enter_region(group, sequence_parallel: bool):
    """A forward pre-hook moving a sub-layer's input x into the region, once for all its column
    layers: f, or the all-gather of the sequence shards (torchtitan's PrepareModuleInput)."""
    def hook(module, args):
        x, *rest = args
        x = gather_from_sequence(x, group) if sequence_parallel else copy_to_region(x, group)
        return (x, *rest)
    return hook


# --8<-- [start:block]
def parallelize_block(block: Block, group, *, sequence_parallel: bool = False, n_kv_head: int | None = None,
                      exact_dropout: bool = False, tracker: RNGTracker | None = None) -> Block:
    """Split one transformer block over `group`, in place (the per-block part of apply_tensor_parallel).
    Under sequence parallelism the block takes and returns (B, T/t, C) sequence shards.
    n_kv_head below t: wk, wv replicated by head; block.dropout > 0 needs the `tracker`."""
    sp = sequence_parallel
    attn, mlp = block.attn, block.mlp
    col = dict(prepare_input=False)  # the pre-hooks below enter each region once
    replicate_kv = n_kv_head is not None and n_kv_head < dist.get_world_size(group)
    for name in ("wq", "wk", "wv"):  # (C -> H*D or K*D): contiguous rows are whole heads
        full = getattr(attn, name)
        if name != "wq" and replicate_kv:
            setattr(attn, name, ReplicatedKVLinear(full, n_kv_head, group))
        else:
            setattr(attn, name, ColumnParallelLinear.from_linear(full, group, **col))
    attn.wo = RowParallelLinear.from_linear(attn.wo, group, sequence_parallel=sp)
    attn.register_forward_pre_hook(_enter_region(group, sp))
    if isinstance(mlp, SwiGLU):  # an MoE feed-forward (tinyscale.moe) stays whole on every TP rank
        mlp.w_gate = ColumnParallelLinear.from_linear(mlp.w_gate, group, **col)
        mlp.w_up = ColumnParallelLinear.from_linear(mlp.w_up, group, **col)
        mlp.w_down = RowParallelLinear.from_linear(mlp.w_down, group, sequence_parallel=sp)
        mlp.register_forward_pre_hook(_enter_region(group, sp))
    if sp:
        block.attn_norm = SequenceParallelRMSNorm(block.attn_norm, group)
        block.mlp_norm = SequenceParallelRMSNorm(block.mlp_norm, group)
    if block.dropout > 0 and block.dropout_masks == "counter":  # global coordinates: no stream to manage
        rank, heads = dist.get_rank(group), attn.wq.weight.shape[0] // attn.head_dim  # heads per rank
        attn.head_offset = rank * heads  # this rank's first head, globally
        block.sequence_shard = (rank, dist.get_world_size(group)) if sp else None
    elif block.dropout > 0:
        add_tensor_parallel_dropout(block, group, sequence_parallel=sp, exact=exact_dropout, tracker=tracker)
    return block
# --8<-- [end:block]


def apply_tensor_parallel(model: GPT, mesh_or_group, *, sequence_parallel: bool = False,
                          exact_dropout: bool = False, dropout_seed: int = 0) -> GPT:
    """Split `model` (the same full GPT on every rank) over the TP group, in place; returns it.
    Dropout: the tracker seeds each rank's own stream with dropout_seed (+ offset + tp rank);
    exact_dropout=True draws one process's masks instead (see `random.py` for the costs)."""
    if not isinstance(model, GPT):
        raise TypeError(f"apply_tensor_parallel takes a tinyscale GPT, got {type(model).__name__}")
    if isinstance(model, TensorParallelGPT):
        raise ValueError("apply_tensor_parallel: this model is already tensor-parallel")
    group = _tp_group(mesh_or_group)
    cfg, tp = model.config, dist.get_world_size(group)
    check_tensor_parallel(cfg, tp)
    sp = sequence_parallel
    model.embed = VocabParallelEmbedding.from_embedding(model.embed, group, sequence_parallel=sp)
    tracker = RNGTracker(dropout_seed, dist.get_rank(group), model.embed.weight.device)
    for block in model.blocks:
        parallelize_block(block, group, sequence_parallel=sp, n_kv_head=cfg.kv_heads, exact_dropout=exact_dropout,
                          tracker=tracker)
    if sp:
        model.norm = SequenceParallelRMSNorm(model.norm, group)
    tied = cfg.tie_embeddings
    model.head = ColumnParallelLinear.from_linear(model.head, group, pad_out_features=True, sequence_parallel=sp)
    if tied:  # both split by vocab rows: one shard, one Parameter, gradients adding up as before
        model.head.weight = model.embed.weight
    model.tp_group, model.sequence_parallel, model.rng_tracker = group, sp, tracker
    model.__class__ = TensorParallelGPT  # a new forward, as FSDP2's fully_shard swaps classes
    return model


class TensorParallelGPT(GPT):
    """A GPT after `apply_tensor_parallel` (never constructed directly): its forward feeds the
    local logits to the vocab-parallel loss instead of gathering them."""

    tp_group: object
    sequence_parallel: bool
    rng_tracker: RNGTracker  # this rank's own dropout stream (tracker mode)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        cfg, group = self.config, self.tp_group
        check_ids(idx, cfg, "idx")
        B, T = idx.shape
        tp = dist.get_world_size(group)
        if self.sequence_parallel and T % tp != 0:
            raise ValueError(f"sequence parallel: sequence length T={T} is not divisible by tp={tp}; "
                             f"use a T that is a multiple of {tp}, or sequence_parallel=False")
        x = self.embed(idx)  # (B, T, C), or (B, T/t, C) under sequence parallelism
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, D): attention sees the whole sequence
        for block in self.blocks:
            x = block(x, cos, sin)
        local_logits = self.head(self.norm(x))  # (B, T, Vp/t)
        if targets is None:  # logits for inference: gather the vocab, drop the padding
            return gather_from_region(local_logits, group)[..., : cfg.vocab_size]  # (B, T, V)
        if targets.shape != idx.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} != idx shape {tuple(idx.shape)}: "
                             "targets must be idx shifted by one position, same (B, T)")
        check_ids(targets, cfg, "targets")
        local_logits = local_logits.reshape(B * T, -1).to(compute_dtype(local_logits.dtype))  # (B*T, Vp/t)
        losses = vocab_parallel_cross_entropy(local_logits, targets.reshape(B * T).long(), group,
                                              vocab_size=cfg.vocab_size)  # (B*T,)
        return self.add_aux_losses(losses.mean())  # an MoE GPT's aux losses (tinyscale.moe) train with it


@torch.no_grad()
def full_state_dict_from_tp(model: nn.Module, group=None) -> dict[str, torch.Tensor]:
    """The original model's state_dict from a tensor-parallel one: same keys, full unpadded tensors,
    the same on every rank (a collective: call it on every rank of the TP group). Each layer
    gathers over its own group; `group` (a ProcessGroup or ParallelMesh), if given, must be it."""
    split_over = getattr(model, "tp_group", None)
    if group is not None and split_over is not None:
        given, expected = dist.get_process_group_ranks(_tp_group(group)), dist.get_process_group_ranks(split_over)
        if given != expected:
            raise ValueError(f"full_state_dict_from_tp: `group` has ranks {given}, but the model was split over "
                             f"ranks {expected}: pass that group (or its ParallelMesh), or no group")
    out = {}
    for key, local in model.state_dict().items():
        path, _, leaf = key.rpartition(".")
        owner = model.get_submodule(path)
        if hasattr(owner, "full_tensor"):
            out[key] = owner.full_tensor(leaf, local)
        else:
            out[key] = local.detach().clone()
    return out
