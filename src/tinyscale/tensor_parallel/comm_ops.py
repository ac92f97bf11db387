"""The conjugate communication operators of tensor and sequence parallelism, as autograd functions.

Megatron-LM (Shoeybi et al. 2019, sec. 3, fig. 3) names two operators, f and g, that are each
other's transpose: what one does forward the other does backward.

    copy_to_region       f   forward identity          backward all-reduce
    reduce_from_region   g   forward all-reduce        backward identity
    gather_from_region       forward all-gather (last dim)      backward split (keep own slice)
    scatter_to_region        forward split (keep own slice)     backward all-gather (last dim)

Sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2, fig. 5) replaces f by their g, an
all-gather along the sequence, and Megatron's g by their g-bar, a reduce-scatter along the
sequence, so the same bytes move (an all-reduce *is* a reduce-scatter followed by an
all-gather) while the activations between two tensor-parallel regions are stored 1/t per rank:

    gather_from_sequence        SP's g      forward all-gather (seq dim)   backward reduce-scatter
    reduce_scatter_to_sequence  SP's g-bar  forward reduce-scatter         backward all-gather
    split_to_sequence                       forward split (seq dim)        backward all-gather

Every collective goes through `tinyscale.dist.comm`, so a ledger counts it. The math (the
layers) lives in `layers.py`; this file only moves tensors.

Uneven sizes: splitting a dimension of size n over t ranks requires n % t == 0; otherwise a
ValueError names both numbers. Callers that need uneven sizes pad first (the vocab-parallel
layers do; see `layers.py`).

Shape legend: B batch rows, T sequence length, T/t a rank's sequence shard, X any trailing dims.
The lesson: lessons/07-tensor-parallel.md. Run: `pytest tests/tensor_parallel -k tp_comm`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tinyscale.dist import comm

SEQ_DIM = 1  # tinyscale's activations are batch-first: (B, T, C)


def _check_divisible(size: int, parts: int, what: str) -> None:
    if size % parts != 0:
        raise ValueError(f"{what}: size {size} is not divisible by the tensor-parallel degree {parts}; "
                         f"choose a size that is a multiple of {parts}, or another degree")


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous 1/t slice of `x` along `dim` (no communication)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    _check_divisible(x.shape[dim], n, f"splitting dim {dim} of a tensor of shape {tuple(x.shape)}")
    return x.chunk(n, dim=dim)[r].contiguous()


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out, group=group)
    return out


def all_gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's `x`, concatenated along `dim` in rank order (not differentiable)."""
    n, x = dist.get_world_size(group), x.contiguous()
    # The flat collective gathers along dim 0: the output is t inputs stacked, which gloo wants
    # shaped (t * x.shape[0], ...); then the rank axis moves to `dim`.
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x, group=group)
    out = out.view(n, *x.shape)  # (t, *x.shape)
    dim = dim % x.dim()
    return out.movedim(0, dim).flatten(dim, dim + 1)  # (..., t * x.shape[dim], ...)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The sum over ranks of `x`, this rank keeping its 1/t slice along `dim` (not differentiable)."""
    n = dist.get_world_size(group)
    _check_divisible(x.shape[dim], n, f"reduce-scattering dim {dim} of a tensor of shape {tuple(x.shape)}")
    chunks = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()  # (t, ..., size/t, ...)
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, chunks.flatten(0, 1), group=group)  # input (t * out.shape[0], ...), as gloo wants
    return out


# --8<-- [start:f-g]
class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None
# --8<-- [end:f-g]


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, -1, ctx.group), None


# --8<-- [start:sp-ops]
class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim(grad, SEQ_DIM, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, SEQ_DIM, ctx.group), None
# --8<-- [end:sp-ops]


class _SplitToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, SEQ_DIM, ctx.group), None


def copy_to_region(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's f: forward identity, backward all-reduce. Put it where a replicated tensor
    enters a tensor-parallel region: each rank's part of the region contributes a partial
    gradient of it, and the all-reduce sums them."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group) -> torch.Tensor:
    """Megatron's g: forward all-reduce, backward identity. Put it where a region's partial
    sums leave it (after a row-parallel matmul): the sum is replicated, so is its gradient."""
    return _ReduceFromRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward all-gather along the last (hidden) dim, backward keep this rank's slice."""
    return _GatherFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward keep this rank's slice of the last (hidden) dim, backward all-gather."""
    return _ScatterToRegion.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Sequence parallelism's g (in place of f): forward all-gather (B, T/t, X) -> (B, T, X),
    backward reduce-scatter (each rank's region gave a partial gradient of the whole sequence)."""
    return _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Sequence parallelism's g-bar (in place of Megatron's g): forward reduce-scatter of partial
    sums (B, T, X) -> (B, T/t, X), backward all-gather."""
    return _ReduceScatterToSequence.apply(x, group)


def split_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Forward keep this rank's sequence shard (B, T, X) -> (B, T/t, X), backward all-gather."""
    return _SplitToSequence.apply(x, group)
