"""Checkpointed segments: one checkpoint around each run of k consecutive layers (Chen et al.).

    y = checkpoint_in_segments(model.blocks, x, cos, sin, segment_size=2)  # blocks 0-1, 2-3, ...

Chen et al., "Training Deep Nets with Sublinear Memory Cost" (2016, arXiv:1604.06174): split n
layers into n/k segments and keep only each segment's input. Backward recomputes one
segment at a time, so the peak holds the n/k kept inputs plus one segment's activations:

    memory(k) ~ (n / k) I + k A        I: a layer's input bytes, A: what one layer saves

smallest at k = sqrt(n I / A). For a chain of small layers (A ~ I) that is the famous
k = sqrt(n) and O(sqrt(n)) memory. A transformer block saves 30-100x its input (formula.py),
so sqrt(n I / A) < 1 for any realistic depth: one block per segment (policy "full") is then
already the best split, which the lesson measures. As in torch.utils.checkpoint's
checkpoint_sequential, the last segment runs without checkpoint: backward needs its
activations first, so recomputing them would save nothing.
Lesson: lessons/05-activation-checkpointing.md. Tests: `pytest -k activation_checkpoint`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tinyscale.checkpointing.api import checkpoint


# --8<-- [start:segments]
def checkpoint_in_segments(layers: Sequence[Callable], x: torch.Tensor, *args, segment_size: int,
                           use_reentrant: bool = False, preserve_rng_state: bool = True) -> torch.Tensor:
    """Run `x` through `layer(x, *args)` for each layer in order, each run of `segment_size`
    consecutive layers under one checkpoint (the last run not checkpointed)."""
    if not isinstance(segment_size, int) or isinstance(segment_size, bool) or segment_size < 1:
        raise ValueError(f"segment_size={segment_size!r}: it must be a positive int (layers per segment)")

    def run(segment: Sequence[Callable]) -> Callable:
        def forward(x: torch.Tensor, *extra) -> torch.Tensor:
            for layer in segment:
                x = layer(x, *extra)
            return x
        return forward

    starts = range(0, len(layers), segment_size)
    for start in starts:
        segment = run(layers[start:start + segment_size])
        if start == starts[-1]:
            x = segment(x, *args)  # the last segment: its activations are needed first in backward
        else:  # args are checkpoint inputs, not closure variables: re-entrant gives them gradients too
            x = checkpoint(segment, x, *args, use_reentrant=use_reentrant, preserve_rng_state=preserve_rng_state)
    return x
# --8<-- [end:segments]
