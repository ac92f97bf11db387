"""Checkpoint state across tensor-parallel layouts: by parameter name, as full tensors.

A checkpoint holds the original model's keys with full, unpadded tensors, whatever the layout
(`engine/checkpoint.py`). Under tensor parallelism each rank holds shards; these helpers turn
a by-name state of this rank's shards into the full one (a collective over the TP group,
`full_tensor` of each TP layer) and cut a full one back to this rank's shards (no
communication: every rank reads the whole file). Optimizer states with a parameter's shape
(Adam's moments, SGD's momentum) are split as the parameter is; scalars (step) are shared.
A replicated K/V head (`ReplicatedKVLinear`) is saved once per head and loaded into every copy.

    full = gather_state(model, local_shapes, state)      # {name: {key: tensor}} on every rank
    local = shard_state(model, local_shapes, full)       # this rank's shards again
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tinyscale.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tinyscale.tensor_parallel.kv_heads import ReplicatedKVLinear


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return model.get_submodule(path), leaf


def _rows(full: torch.Tensor, rows: int, group) -> torch.Tensor:
    """This rank's `rows` rows of `full` zero-padded to t * rows rows (the vocab padding)."""
    r = dist.get_rank(group)
    padded = full.new_zeros((rows * dist.get_world_size(group), *full.shape[1:]))
    padded[: full.shape[0]] = full
    return padded[r * rows:(r + 1) * rows].clone()


def shard(owner: nn.Module, leaf: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the full tensor `full` of `owner`'s parameter `leaf` (or a state of its shape)."""
    if hasattr(owner, "shard_tensor"):  # a layer that cuts its own (tensor_parallel/fused.py)
        return owner.shard_tensor(leaf, full)
    if isinstance(owner, ColumnParallelLinear):
        return _rows(full, owner.local_out, owner.group)  # (O, C) -> (O/t, C)
    if isinstance(owner, VocabParallelEmbedding):
        return _rows(full, owner.local_rows, owner.group)  # (V, C) -> (Vp/t, C)
    if isinstance(owner, RowParallelLinear) and leaf == "weight":
        cols = owner.in_features // dist.get_world_size(owner.group)
        return _rows(full.t(), cols, owner.group).t().contiguous()  # (O, C) -> (O, C/t)
    if isinstance(owner, ReplicatedKVLinear):  # (K*D, C) -> (D, C): the K/V head this rank reads (a bias too)
        return full[owner.head * owner.head_dim:(owner.head + 1) * owner.head_dim].clone()
    return full.clone()  # replicated: norms, a row layer's bias


def full_shape(owner: nn.Module, leaf: str, local: torch.Size) -> torch.Size:
    """The original tensor's shape (no communication)."""
    if hasattr(owner, "full_shape"):
        return owner.full_shape(leaf, local)
    if isinstance(owner, ColumnParallelLinear):
        return torch.Size((owner.out_features, *local[1:]))
    if isinstance(owner, VocabParallelEmbedding):
        return torch.Size((owner.num_embeddings, *local[1:]))
    if isinstance(owner, RowParallelLinear) and leaf == "weight":
        return torch.Size((owner.out_features, owner.in_features))
    if isinstance(owner, ReplicatedKVLinear):  # (K*D, C), or a bias's (K*D,)
        return torch.Size((owner.n_kv_head * owner.head_dim, *local[1:]))
    return local


def full_shapes(model: nn.Module, local_shapes: dict[str, torch.Size]) -> dict[str, torch.Size]:
    return {k: full_shape(*_owner(model, k), s) for k, s in local_shapes.items()}


def shard_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state_dict (original keys) cut to this rank's shards, for `model.load_state_dict`."""
    return {k: shard(*_owner(model, k), v) for k, v in state.items()}


def _is_split(value, local_shape: torch.Size) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == local_shape


def gather_state(model: nn.Module, local_shapes: dict[str, torch.Size], state: dict[str, dict],
                 device: torch.device) -> dict[str, dict]:
    """{name: {key: value}} of this rank's shards -> full tensors, on CPU (every TP rank calls it,
    with the same names in the same order)."""
    out = {}
    for name, entry in state.items():
        owner, leaf = _owner(model, name)
        out[name] = {key: owner.full_tensor(leaf, value.to(device)).cpu()
                     if hasattr(owner, "full_tensor") and _is_split(value, local_shapes[name]) else value
                     for key, value in entry.items()}
    return out


def shard_state(model: nn.Module, local_shapes: dict[str, torch.Size], state: dict[str, dict]) -> dict[str, dict]:
    """Inverse of `gather_state`: full by-name tensors cut to this rank's shards."""
    shapes = full_shapes(model, local_shapes)
    return {name: {key: shard(*_owner(model, name), value) if _is_split(value, shapes[name]) else value
                   for key, value in entry.items()}
            for name, entry in state.items()}
