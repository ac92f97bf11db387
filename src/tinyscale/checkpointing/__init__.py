"""Activation checkpointing: keep fewer activations for backward, recompute (or offload) the rest.

    from tinyscale.checkpointing import checkpoint, apply_policy, saved_bytes
    y = checkpoint(block, x, cos, sin, use_reentrant=False)   # one call, recomputed in backward
    model = apply_policy(GPT(cfg), "selective")                # a policy for the whole GPT
    saved_bytes(model, idx, targets)                           # bytes kept for backward

Files, in reading order: replay.py (the RNG and autocast state a recomputation replays),
reentrant.py (an autograd Function that reruns fn in its backward), nonreentrant.py
(saved-tensor hooks that save indices and recompute on first unpack), api.py
(`checkpoint`), offload.py (saved tensors to host memory), saved_inputs.py (a checkpoint's
inputs split over a tensor-parallel group or on the host: DeepSpeed's partition_activations and
cpu_checkpointing), policies.py (none, full,
every_k, selective, offload for the GPT), segments.py (Chen et al.'s segments of k
layers), measure.py (saved and peak bytes), formula.py
(bytes per layer: Korthikanti et al.'s formula and ours).

The seam the tests use: a checkpoint implementation is a callable
`impl(fn, *args, **kwargs)` returning fn's output, with gradients identical to calling fn.
Chen et al., "Training Deep Nets with Sublinear Memory Cost" (2016, arXiv:1604.06174);
Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022,
arXiv:2205.05198): the per-layer activation memory and selective activation recomputation.
Lesson: lessons/05-activation-checkpointing.md. Tests: `pytest -k activation_checkpoint`.
"""

from tinyscale.checkpointing.api import checkpoint
from tinyscale.checkpointing.formula import block_saved_bytes, korthikanti_layer_bytes, model_saved_bytes_drop
from tinyscale.checkpointing.measure import SavedTensor, peak_bytes, saved_bytes, saved_tensors
from tinyscale.checkpointing.nonreentrant import checkpoint_nonreentrant
from tinyscale.checkpointing.offload import offload_to_host
from tinyscale.checkpointing.policies import (
    POLICIES,
    CheckpointedBlock,
    CheckpointPolicy,
    OffloadedBlock,
    SelectiveAttention,
    apply_policy,
    policy_of,
    remove_policy,
)
from tinyscale.checkpointing.reentrant import checkpoint_reentrant
from tinyscale.checkpointing.segments import checkpoint_in_segments

__all__ = [
    "POLICIES",
    "CheckpointPolicy",
    "CheckpointedBlock",
    "OffloadedBlock",
    "SavedTensor",
    "SelectiveAttention",
    "apply_policy",
    "block_saved_bytes",
    "checkpoint",
    "checkpoint_in_segments",
    "checkpoint_nonreentrant",
    "checkpoint_reentrant",
    "korthikanti_layer_bytes",
    "model_saved_bytes_drop",
    "offload_to_host",
    "peak_bytes",
    "policy_of",
    "remove_policy",
    "saved_bytes",
    "saved_tensors",
]
