"""Pipeline x tensor parallelism: this rank's pipeline stages split over its TP group.

The engine's order (`engine/parallelize.py`) cuts the GPT into stages first; then each stage
this rank keeps is split over the tp axis, as `tinyscale.tensor_parallel.apply_tensor_parallel`
splits a whole GPT (Megatron-LM's pp x tp layout, Narayanan et al. 2021, sec. 2.3):

    first stage   the embedding vocab-parallel (rows of ids, summed by g: (B, T, C) on every TP rank)
    every block   wq, wk, wv, w_gate, w_up column-parallel, wo, w_down row-parallel (`parallelize_block`)
    last stage    the final norm replicated, the head column-parallel by vocab rows (padded to Vp),
                  the loss `vocab_parallel_cross_entropy` over the TP group on the local logits

Between stages the activations are full (B, T, C), the same on every TP rank: TP rank i of
stage s sends to TP rank i of stage s + 1 over its own pp group (the mesh's pp axis). With
sequence parallelism they are TP rank i's (B, T/t, C) sequence shard instead (Megatron-LM sends
the same; 1/t of the bytes): the embedding reduce-scatters along the sequence, every block
takes and returns the shard, and the last stage's final norm runs on it before the head
gathers the sequence. A tied table: the first stage's embedding shard i and the last stage's
head shard i hold the same vocab rows (both padded to ceil(V/t) rows per rank), so
`exchange_tied_grads` over TP rank i's pp group pairs the right shards.
Tests: `pytest tests/engine/test_engine_pipeline.py -k tp`.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from tinyscale.models.gpt import GPT
from tinyscale.tensor_parallel import (
    ColumnParallelLinear, SequenceParallelRMSNorm, VocabParallelEmbedding, check_tensor_parallel,
    vocab_parallel_cross_entropy,
)
from tinyscale.tensor_parallel.apply import parallelize_block


# --8<-- [start:split]
def split_stages(model: GPT, stages: dict[int, nn.Module], group, *, sequence_parallel: bool = False) -> None:
    """Split this rank's `stages` (`GPTStage`s sharing `model`'s modules) over the TP `group`, in
    place: the new embedding, final norm and head go into both the stage and `model` (under their
    original names, so the optimizer, the placements and checkpoints find them).
    `sequence_parallel`: the stages take and pass (B, T/t, C) sequence shards."""
    cfg, sp = model.config, sequence_parallel
    check_tensor_parallel(cfg, dist.get_world_size(group))
    for stage in stages.values():
        if stage.embed is not None:  # sequence parallel: reduce-scatters its rows along the sequence
            model.embed = stage.embed = VocabParallelEmbedding.from_embedding(stage.embed, group, sequence_parallel=sp)
        for block in stage.blocks:
            parallelize_block(block, group, sequence_parallel=sp, n_kv_head=cfg.kv_heads)
        if stage.head is not None:  # a tied head gets its own shard of the table (the first stage has the other)
            if sp:  # the final norm on the shard; the head gathers the sequence first
                model.norm = stage.norm = SequenceParallelRMSNorm(stage.norm, group)
            model.head = stage.head = ColumnParallelLinear.from_linear(stage.head, group, pad_out_features=True,
                                                                       sequence_parallel=sp)
        stage.sequence_shards = dist.get_world_size(group) if sp else 1
    model.tp_group = group  # what the engine's TP helpers (clipping under ZeRO, the placements) read
# --8<-- [end:split]


def vocab_parallel_loss(group, vocab_size: int):
    """The last stage's loss_fn: the mean cross-entropy from this rank's vocab slice of the logits."""
    return functools.partial(_vocab_parallel_loss, group=group, vocab_size=vocab_size)


def _vocab_parallel_loss(local_logits: torch.Tensor, targets: torch.Tensor, *, group, vocab_size: int) -> torch.Tensor:
    local_logits = local_logits.flatten(0, 1)  # (B, T, Vp/t) -> (B*T, Vp/t)
    local_logits = local_logits.to(torch.promote_types(local_logits.dtype, torch.float32))
    return vocab_parallel_cross_entropy(local_logits, targets.flatten().long(), group, vocab_size=vocab_size).mean()
