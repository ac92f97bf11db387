"""Column- and row-parallel layers for fused projections and transformers' `Conv1D` (GPT-2).

A fused projection computes several outputs in one matmul: GPT-2's `c_attn` holds q, k and v
side by side in its 3C outputs (Phi-3's `qkv_proj`, Falcon's `query_key_value` likewise). Split
in t contiguous blocks, rank 0 would get all of q and half of k: not whole heads of each. So
`FusedColumnLinear` splits each chunk on its own and keeps, on rank r, [q_r; k_r; v_r]: the
model's own `.split(...)` of the local output then finds this rank's q, k and v heads. Its
shard is no contiguous block of the original weight; `full_tensor` gathers the t shards and
puts every output back where it was.

`Conv1D` is a Linear whose weight is stored transposed, (in, out), y = x @ W + b. The layers
below keep that layout, so state_dict shapes stay the model's: a column split is along dim 1
of the weight (and dim 0 of the bias), a row split along dim 0. An engine asks a layer which
dim a parameter is split along (`tp_split_dim`), cuts a full tensor into this rank's shard
(`shard_tensor`, for checkpoints) and its full shape (`full_shape`), besides `full_tensor`.

Shape legend: B batch, T sequence, C in_features, O out_features (the sum of the chunks), t
tensor-parallel degree. Run: `pytest -k autotp`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tinyscale.tensor_parallel.comm_ops import all_gather_dim, copy_to_region, reduce_from_region


def is_conv1d(layer: nn.Module) -> bool:
    return type(layer).__name__ == "Conv1D"  # transformers.pytorch_utils.Conv1D, without importing it


def _param(value: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(value.detach().clone(), requires_grad=like.requires_grad)


class FusedColumnLinear(nn.Module):
    """A column-parallel Linear or Conv1D whose outputs are `chunks` (sizes, each divisible by t)
    split separately: (..., C) -> (..., O/t), this rank's slice of every chunk in order. f on its input."""

    def __init__(self, layer: nn.Module, group, chunks: list[int]) -> None:
        super().__init__()
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.chunks, self.transposed = group, list(chunks), is_conv1d(layer)
        self.out_dim = 1 if self.transposed else 0  # the weight's output dim: Conv1D (C, O), Linear (O, C)
        starts = [sum(chunks[:i]) for i in range(len(chunks))]
        owned = [torch.cat([torch.arange(s + r * c // tp, s + (r + 1) * c // tp) for s, c in zip(starts, chunks)])
                 for r in range(tp)]  # rank r's outputs, in its local order
        self.index = owned[rank]  # (O/t,) plain attributes, not state: the state_dict stays the model's
        self.restore = torch.argsort(torch.cat(owned))  # gathered (rank-major) order -> the original
        weight = layer.weight.detach()
        self.weight = _param(weight.index_select(self.out_dim, self.index.to(weight.device)), layer.weight)
        self.bias = None if layer.bias is None else _param(layer.bias.detach()[self.index.to(weight.device)],
                                                           layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_region(x, self.group)  # f: backward all-reduces the input's gradient
        weight = self.weight.t() if self.transposed else self.weight  # (O/t, C)
        return F.linear(x, weight, self.bias)  # (..., C) -> (..., O/t)

    def tp_split_dim(self, name: str) -> int:
        return self.out_dim if name == "weight" else 0

    def full_tensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        dim = self.tp_split_dim(name)
        gathered = all_gather_dim(local.detach(), dim, self.group)  # rank-major: [r0's chunks, r1's, ...]
        return gathered.index_select(dim, self.restore.to(gathered.device))

    def shard_tensor(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full.index_select(self.tp_split_dim(name), self.index.to(full.device)).clone()

    def full_shape(self, name: str, local: torch.Size) -> torch.Size:
        dim, shape = self.tp_split_dim(name), list(local)
        shape[dim] = sum(self.chunks)
        return torch.Size(shape)

    def extra_repr(self) -> str:
        return f"chunks={self.chunks} ({len(self.index)} outputs per rank), conv1d={self.transposed}"


class RowParallelConv1D(nn.Module):
    """transformers' Conv1D split by input rows: (..., C/t) -> (..., O), summed over the group (g);
    its weight (C/t, O), its bias replicated and added once after the sum."""

    def __init__(self, layer: nn.Module, group) -> None:
        super().__init__()
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = layer.weight.shape[0] // tp
        self.group, self.in_features = group, layer.weight.shape[0]
        self.weight = _param(layer.weight.detach()[rank * rows:(rank + 1) * rows], layer.weight)  # (C/t, O)
        self.bias = _param(layer.bias.detach(), layer.bias)  # (O,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = torch.matmul(x, self.weight)  # (..., C/t) @ (C/t, O) -> (..., O), a partial sum
        return reduce_from_region(partial, self.group) + self.bias

    def tp_split_dim(self, name: str) -> int | None:
        return 0 if name == "weight" else None

    def full_tensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        return all_gather_dim(local.detach(), 0, self.group) if name == "weight" else local.detach().clone()

    def shard_tensor(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name != "weight":
            return full.clone()
        rows = self.weight.shape[0]
        rank = dist.get_rank(self.group)
        return full[rank * rows:(rank + 1) * rows].clone()

    def full_shape(self, name: str, local: torch.Size) -> torch.Size:
        return torch.Size((self.in_features, *local[1:])) if name == "weight" else local
