"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding, SP RMSNorm.

Megatron-LM (Shoeybi et al. 2019, sec. 3). A linear y = x W^T with W of shape (out, in):

- column-parallel: rank r holds rows [r*out/t, (r+1)*out/t) of W, computes its slice of y's
  last dim from the whole x. Input replicated, output sharded on the hidden dim.
- row-parallel: rank r holds columns [r*in/t, (r+1)*in/t) of W, multiplies its slice of x's
  last dim; the t partial products sum to y (one all-reduce). Input sharded, output replicated.

Column then row (an MLP, or attention's q/k/v then o) needs no communication in between and
one all-reduce at the end: Megatron's g. Its backward mirror is f on the region's input.

Each layer is built from the full `nn.Linear` / `nn.Embedding` by `from_linear` /
`from_embedding`: every rank slices the same full weight, so a tensor-parallel model starts
identical to the single-process one. Parameter names stay `weight` / `bias`, so state_dict keys
are unchanged; `full_tensor(name, local)` gathers one back (padding dropped).

Sizes that do not divide t: linear layers refuse (ValueError naming the numbers); the vocab is
padded as Megatron does, to ceil(V/t)*t rows, the padding rows zero, never looked up, and masked
out of the loss (`cross_entropy.py`).

With `sequence_parallel=True`, activations outside the regions are (B, T/t, C) shards:
column layers all-gather their input along the sequence (backward reduce-scatter), row layers
reduce-scatter their output (backward all-gather), and a norm's replicated weight, now used on
a sequence shard, has its gradient all-reduced by passing it through f (`SequenceParallelRMSNorm`).
A column layer here keeps the all-gathered (B, T, C) input for its weight gradient; Megatron
keeps only the shard and all-gathers it again in backward, one more all-gather for T/t the memory.

Shape legend: B batch, T sequence, C in_features, O out_features, t tensor-parallel degree,
V vocab size, Vp padded vocab (ceil(V/t)*t). Run: `pytest tests/tensor_parallel -k tp_layers`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tinyscale.models.gpt import RMSNorm
from tinyscale.tensor_parallel.comm_ops import (
    all_gather_dim,
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
)


def padded_size(size: int, tp: int) -> int:
    """`size` rounded up to a multiple of `tp` (Megatron's vocab padding)."""
    return -(-size // tp) * tp


def _shard_rows(full: torch.Tensor, rows: int, group) -> torch.Tensor:
    """This rank's `rows`-row slice of `full` zero-padded to t*rows rows (dim 0)."""
    r = dist.get_rank(group)
    padded = full.new_zeros((rows * dist.get_world_size(group), *full.shape[1:]))
    padded[: full.shape[0]] = full
    return padded[r * rows:(r + 1) * rows].clone()


def _keep_frozen(layer: nn.Module, full: nn.Module) -> nn.Module:
    """A frozen parameter of the full layer stays frozen in its shard."""
    for name, param in layer.named_parameters():
        param.requires_grad_(getattr(full, name).requires_grad)
    return layer


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split over the group: (..., C) -> (..., O/t), or
    (..., O) with gather_output=True.

    prepare_input: True applies f to the input here (or, with sequence_parallel, the all-gather
    of the sequence shards). Pass False when several column layers read one input and the caller
    entered the region once for all of them (q/k/v, gate/up in apply.py), so the backward
    communicates once per region, as Megatron's fused QKV and fc1 do.
    """

    def __init__(self, in_features: int, out_features: int, group, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, prepare_input: bool = True,
                 pad_out_features: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        tp = dist.get_world_size(group)
        if out_features % tp != 0 and not pad_out_features:
            raise ValueError(f"ColumnParallelLinear: out_features={out_features} is not divisible by the "
                             f"tensor-parallel degree {tp}; choose a multiple of {tp}")
        if gather_output and out_features % tp != 0:
            raise ValueError(f"ColumnParallelLinear: gather_output needs out_features={out_features} "
                             f"divisible by tp={tp} (padding would show in the output)")
        self.group, self.in_features, self.out_features = group, in_features, out_features
        self.gather_output, self.sequence_parallel, self.prepare_input = gather_output, sequence_parallel, prepare_input
        self.local_out = padded_size(out_features, tp) // tp
        self.weight = nn.Parameter(torch.empty(self.local_out, in_features, device=device, dtype=dtype))  # (O/t, C)
        self.bias = nn.Parameter(torch.empty(self.local_out, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, **kwargs) -> ColumnParallelLinear:
        """This rank's rows of `linear` (the same full layer on every rank)."""
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device=w.device, dtype=w.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(_shard_rows(w, layer.local_out, group))
            if layer.bias is not None:
                layer.bias.copy_(_shard_rows(linear.bias, layer.local_out, group))
        return _keep_frozen(layer, linear)

    # --8<-- [start:column-forward]
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.prepare_input:
            x = gather_from_sequence(x, self.group) if self.sequence_parallel else copy_to_region(x, self.group)
        y = F.linear(x, self.weight, self.bias)  # (..., C) @ (C, O/t) -> (..., O/t)
        return gather_from_region(y, self.group) if self.gather_output else y  # (..., O) if gathered
    # --8<-- [end:column-forward]

    def full_tensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        return all_gather_dim(local.detach(), 0, self.group)[: self.out_features]

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} ({self.local_out} per rank), "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split over the group: (..., C/t) -> (..., O), the
    partial products summed by g (or reduce-scattered along the sequence with sequence_parallel).

    input_is_parallel: True when x is already split on its last dim (the output of a column
    layer); False splits a replicated x here (scatter_to_region)."""

    def __init__(self, in_features: int, out_features: int, group, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        tp = dist.get_world_size(group)
        if in_features % tp != 0:
            raise ValueError(f"RowParallelLinear: in_features={in_features} is not divisible by the "
                             f"tensor-parallel degree {tp}; choose a multiple of {tp}")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True "
                             "(Megatron's rule: the input comes from a column-parallel layer)")
        self.group, self.in_features, self.out_features = group, in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp, device=device, dtype=dtype))  # (O, C/t)
        # The bias is added once, after the sum; replicated. Under sequence parallelism it meets
        # a sequence shard, so its gradient goes through f like a norm weight's.
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, **kwargs) -> RowParallelLinear:
        """This rank's columns of `linear` (the same full layer on every rank)."""
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device=w.device, dtype=w.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(_shard_rows(w.t(), layer.weight.shape[1], group).t())
            if layer.bias is not None:
                layer.bias.copy_(linear.bias)
        return _keep_frozen(layer, linear)

    # --8<-- [start:row-forward]
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.group)  # (..., C) -> (..., C/t)
        partial = F.linear(x, self.weight)  # (..., C/t) @ (C/t, O) -> (..., O), a partial sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(partial, self.group)  # (B, T, O) -> (B, T/t, O)
        else:
            y = reduce_from_region(partial, self.group)
        if self.bias is None:
            return y
        return y + (copy_to_region(self.bias, self.group) if self.sequence_parallel else self.bias)
    # --8<-- [end:row-forward]

    def full_tensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        return all_gather_dim(local.detach(), 1, self.group) if name == "weight" else local.detach().clone()

    def extra_repr(self) -> str:
        return (f"in={self.in_features} ({self.weight.shape[1]} per rank), out={self.out_features}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """A lookup table split by rows (vocab) over the group: rank r holds ids
    [r*Vp/t, (r+1)*Vp/t). Ids outside its shard read a zero vector; summing over ranks (g, or
    a reduce-scatter along the sequence with sequence_parallel) gives every id its row.
    (B, T) ids -> (B, T, C), or (B, T/t, C) with sequence_parallel."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group, *, sequence_parallel: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.num_embeddings, self.embedding_dim = group, num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        self.local_rows = padded_size(num_embeddings, tp) // tp  # ceil(V/t)
        self.vocab_start = rank * self.local_rows  # this rank's ids: [vocab_start, vocab_start + local_rows)
        self.weight = nn.Parameter(torch.empty(self.local_rows, embedding_dim, device=device, dtype=dtype))  # (Vp/t, C)
        self.padding_idx = None  # nn.Embedding's: that row gets no gradient (set by from_embedding)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group, **kwargs) -> VocabParallelEmbedding:
        w = embedding.weight
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, device=w.device, dtype=w.dtype,
                    **kwargs)
        layer.padding_idx = embedding.padding_idx
        with torch.no_grad():
            layer.weight.copy_(_shard_rows(w, layer.local_rows, group))  # padding rows: zeros
        return _keep_frozen(layer, embedding)

    # --8<-- [start:embedding-forward]
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start  # (B, T)
        outside = (local < 0) | (local >= self.local_rows)
        pad = None if self.padding_idx is None else self.padding_idx - self.vocab_start
        pad = pad if pad is not None and 0 <= pad < self.local_rows else None  # this rank's, if it holds it
        rows = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=pad)  # (B, T, C)
        # Zero the rows of ids another rank owns; their gradient is zero too, so row 0 of this
        # shard (used as a stand-in index) gets nothing from them.
        partial = rows.masked_fill(outside.unsqueeze(-1), 0.0)  # (B, T, C)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(partial, self.group)  # (B, T/t, C)
        return reduce_from_region(partial, self.group)
    # --8<-- [end:embedding-forward]

    def full_tensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        return all_gather_dim(local.detach(), 0, self.group)[: self.num_embeddings]

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows {self.vocab_start}.."
                f"{self.vocab_start + self.local_rows - 1} on this rank, sequence_parallel={self.sequence_parallel}")


class SequenceParallelRMSNorm(RMSNorm):
    """RMSNorm on a sequence shard (B, T/t, C): the weight is replicated, but each rank sees only
    its tokens, so its gradient is a partial sum; f (copy_to_region) on the weight all-reduces it
    in backward. Shares the original norm's Parameter (same state_dict key)."""

    def __init__(self, norm: RMSNorm, group) -> None:
        nn.Module.__init__(self)
        self.eps, self.weight, self.group = norm.eps, norm.weight, group

    # --8<-- [start:sp-norm]
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * copy_to_region(self.weight, self.group)
    # --8<-- [end:sp-norm]
