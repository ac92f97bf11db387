"""DeepSpeed's ``zero_optimization.sub_group_size``: step each rank's shard in sub-groups.

A rank's shards of all its units, laid end to end, are cut every `size` elements; each piece
is a sub-group, and the optimizer steps one sub-group at a time (DeepSpeed's stage 3 does the
same to its flat fp32 partition). What one step of the torch optimizer allocates (AdamW:
``exp_avg_sq.sqrt()`` and the denominator, each as large as what it steps) and, with offload,
the gradient copied down to the host, are then as large as one sub-group, not the whole
shard. The optimizer is elementwise, so stepping in pieces changes no value: training is
bit-for-bit the same (`torch.equal`), only the step's temporary memory shrinks.

    starts = sub_group_starts(base, shard_numel, size)   # cut points inside one unit's shard
    groups = group_fragments(fragments, bases, size)     # [[(unit, fragment), ...], ...]

`ShardedOptimizer` cuts each parameter fragment at the starts, so that every fragment lies
in one sub-group. ``size`` None: one sub-group (the whole shard, one optimizer step).
Lesson: lessons/03-zero.md, "Sub-groups". Tests: ``pytest -k deepspeed_config_sub_group``.
"""

from __future__ import annotations

from collections.abc import Sequence


def sub_group_starts(base: int, shard_numel: int, size: int | None) -> list[int]:
    """Offsets inside a shard of `shard_numel` elements, placed at `base` in the rank's
    concatenated shards, where a new sub-group of `size` elements begins (0 excluded)."""
    if size is None:
        return []
    first = -(-base // size) * size - base  # the first multiple of size at or after base, local
    return [k for k in range(first, shard_numel, size) if k > 0]


def group_fragments(fragments: Sequence[Sequence], bases: Sequence[int],
                    size: int | None) -> list[list[tuple[int, int]]]:
    """(unit, fragment index) pairs by sub-group, in order; fragments must not straddle a cut."""
    groups: dict[int, list[tuple[int, int]]] = {}
    for i, (frags, base) in enumerate(zip(fragments, bases)):
        for k, f in enumerate(frags):
            groups.setdefault(0 if size is None else (base + f.start) // size, []).append((i, k))
    return [groups[g] for g in sorted(groups)]
