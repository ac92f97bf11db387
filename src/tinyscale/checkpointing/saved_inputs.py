"""Where a checkpoint keeps its inputs: split over a tensor-parallel group, and/or on the host.

    with keep_inputs(partition_group=tp_group, to_host=True):   # around checkpoint(...) only
        y = checkpoint(block, x, cos, sin, use_reentrant=False)

A checkpoint saves its inputs and nothing else (both variants save them through autograd, so
saved-tensor hooks around the call see them; fn's own tensors are the checkpoint's business).
Two DeepSpeed options act on exactly those tensors:

- `partition_activations` (DeepSpeed; Megatron-LM's `--distribute-saved-activations`): under
  tensor parallelism a block's input (B, T, C) is the same on every rank of the group, so each
  rank keeps only its 1/t of the flattened tensor and backward all-gathers it before the rerun:
  t times less memory for the checkpoints, one all-gather per checkpoint in backward. Only a
  tensor equal on every rank of the group may be split so: under sequence parallelism the
  input is already this rank's own shard (the same saving, no gather), and selective
  checkpointing's inputs q, k, v are this rank's heads; the engine refuses both.
- `cpu_checkpointing`: the kept tensor (or its slice) goes to host memory and comes back for
  the rerun (offload.py's trade, for the checkpoints only).

Only tensors that require grad (the activations) are split; constants saved beside them (the
RoPE tables) are kept whole, and so is a leaf (a pipeline stage's received input, which the
executor holds anyway). Parameters (and views of them) are left alone, as in offload.py.
Shape legend: t the group's size, n a saved tensor's number of elements, padded to a multiple of t.
Lesson: lessons/05-activation-checkpointing.md. Tests: `pytest -k layout_activation_checkpointing`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.graph import saved_tensors_hooks

from tinyscale.checkpointing.offload import _is_parameter, _pack_to_host, _unpack_from_host
from tinyscale.dist import comm


# --8<-- [start:keep-inputs]
class keep_inputs(saved_tensors_hooks):
    """Context manager: tensors saved inside it (wrap a checkpoint() call: its inputs) are kept
    as this rank's slice over `partition_group` (None: whole) and, with `to_host`, in host memory."""

    def __init__(self, partition_group=None, to_host: bool = False) -> None:
        self.group, self.to_host = partition_group, to_host
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        if _is_parameter(t):
            return t  # lives on the device anyway
        kept, split = t, self.group is not None and t.requires_grad  # an activation, not a constant (RoPE)
        if split:  # this rank's 1/t of the flattened tensor, (n / t,)
            size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
            flat = t.detach().reshape(-1)
            per_rank = -(-flat.numel() // size)
            kept = flat.new_zeros(per_rank * size)
            kept[: flat.numel()] = flat
            kept = kept[rank * per_rank:(rank + 1) * per_rank].clone()  # the rest is freed
        return t.shape, split, _pack_to_host(kept) if self.to_host else kept  # autograd restores requires_grad

    def _unpack(self, packed) -> torch.Tensor:
        if torch.is_tensor(packed):
            return packed
        shape, split, kept = packed
        kept = _unpack_from_host(kept) if self.to_host else kept
        if not split:
            return kept
        full = kept.new_empty(kept.numel() * dist.get_world_size(self.group))  # (n padded,)
        comm.all_gather(full, kept, group=self.group)  # every rank of the group reruns this block now
        return full[: shape.numel()].view(shape)
# --8<-- [end:keep-inputs]
