"""The one rule for splitting a global batch over data-parallel ranks and micro-batches.

The reference trainer and every parallel topic split batches with these functions, so a
parallel run sees exactly the rows a single process sees, and in the same order.

The rule. A global batch is a tuple of tensors that share dim 0 (the rows), e.g.
(inputs, targets). With dp_size data-parallel ranks and micro_batch_size rows per micro-batch:

1. The rows are cut into dp_size contiguous blocks of equal size; block r (rows
   r*R .. (r+1)*R - 1, where R = rows // dp_size) goes to data-parallel rank r.
2. Each rank cuts its block into contiguous micro-batches of micro_batch_size rows,
   processed in order; there are R // micro_batch_size of them (the gradient accumulation steps).
3. Every tensor of the tuple is cut the same way, so row i of inputs stays with row i of targets.

Hence concatenating all micro-batches in (rank, micro-batch) order gives back the global batch,
and rows == train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp_size must hold
exactly (DeepSpeed's identity for train_batch_size); anything else is a ValueError. Ranks
holding tensor/pipeline/context shards of one model share a dp_rank and get the same rows.

All results are views of the global batch (no copies): do not modify them in place. A view
kept keeps the whole global batch's storage alive; no engine path keeps one past its step
(`tests/engine/test_batch_views_freed.py`; the pipeline executor drops its run's ids and targets
when the run ends).

Shape legend: N global rows, R = N // dp_size rows per rank, M = micro_batch_size.
"""

from __future__ import annotations

import torch

_IDENTITY = ("train_batch_size must equal train_micro_batch_size_per_gpu x gradient_accumulation_steps "
             "x data-parallel size")


def _num_rows(batch: tuple[torch.Tensor, ...]) -> int:
    """Dim-0 size shared by every tensor of the batch."""
    if not isinstance(batch, (tuple, list)) or len(batch) == 0:
        raise ValueError(f"batch must be a non-empty tuple of tensors, got {type(batch).__name__}: "
                         "wrap a single tensor as (tensor,)")
    sizes = []
    for i, t in enumerate(batch):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise ValueError(f"batch[{i}] must be a tensor with a batch dim 0, got "
                             f"{type(t).__name__} {tuple(getattr(t, 'shape', ()))}")
        sizes.append(t.shape[0])
    if len(set(sizes)) != 1:
        raise ValueError(f"the batch's tensors have different dim-0 sizes {sizes}: every tensor "
                         "must hold one entry per row (inputs and targets row for row)")
    return sizes[0]


def _check_positive(field: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{field}={value!r} is invalid: it must be a positive int")


# --8<-- [start:shard-rows]
def shard_rows(batch: tuple[torch.Tensor, ...], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    """Rank `rank`'s contiguous block of rows: (N, ...) -> (N // world_size, ...) per tensor."""
    _check_positive("world_size", world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} is out of range for world_size={world_size}: "
                         f"it must be in 0..{world_size - 1}")
    rows = _num_rows(batch)
    if rows % world_size:
        raise ValueError(f"the global batch has {rows} rows, not divisible by the data-parallel size "
                         f"{world_size}: {_IDENTITY}")
    per_rank = rows // world_size  # R
    return tuple(t.narrow(0, rank * per_rank, per_rank) for t in batch)  # (R, ...) views


def micro_batches(batch: tuple[torch.Tensor, ...], micro_batch_size: int) -> list[tuple[torch.Tensor, ...]]:
    """Contiguous micro-batches in order: (R, ...) -> R // M tuples of (M, ...) per tensor."""
    _check_positive("micro_batch_size", micro_batch_size)
    rows = _num_rows(batch)
    if rows % micro_batch_size:
        raise ValueError(f"{rows} rows are not divisible by micro_batch_size={micro_batch_size} "
                         f"(train_micro_batch_size_per_gpu): {_IDENTITY}")
    per_tensor = [t.split(micro_batch_size, dim=0) for t in batch]  # each: R // M views of (M, ...)
    return [tuple(chunks) for chunks in zip(*per_tensor)]
# --8<-- [end:shard-rows]


def local_micro_batches(batch: tuple[torch.Tensor, ...], *, dp_rank: int, dp_size: int,
                        micro_batch_size: int) -> list[tuple[torch.Tensor, ...]]:
    """The micro-batches data-parallel rank dp_rank processes, in order: steps 1 and 2 of the rule."""
    _check_positive("dp_size", dp_size)
    _check_positive("micro_batch_size", micro_batch_size)
    rows = _num_rows(batch)
    # Check the whole identity first, so the message states the global numbers.
    if rows % dp_size == 0 and (rows // dp_size) % micro_batch_size:
        raise ValueError(f"the global batch has {rows} rows = {rows // dp_size} per rank over dp_size={dp_size}, "
                         f"not divisible by micro_batch_size={micro_batch_size}: {_IDENTITY}")
    return micro_batches(shard_rows(batch, dp_rank, dp_size), micro_batch_size)
