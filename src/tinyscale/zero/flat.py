"""Flat, padded, sharded buffers: the data structure under every ZeRO stage.

A `FlatUnit` is a list of parameters (one dtype, one device, one optimizer param group)
laid end to end in one 1-D buffer, padded with zeros to a multiple of the group size N so
that it splits into N equal shards. Rank r owns shard r:

    params      [ p0 (6) | p1 (4) | p2 (3) ]                numel 13
    flat        [ p0 ...... p1 .... p2 ... 0 0 0 ]          padded to 16 for N = 4
    shards      [ rank 0 ][ rank 1 ][ rank 2 ][ rank 3 ]    4 elements each

Equal shards are what reduce-scatter and all-gather need (every rank sends and receives
the same count); the padding (at most N - 1 elements per unit) is the price, and it is
counted wherever bytes are counted. A parameter may straddle two shards: the shard is a
slice of the flat buffer, not a set of whole parameters, which is why the optimizer steps
on flat shards rather than on parameters.

Units are how a model is cut: one per parameter group for stage 1, buckets (a few MiB,
reverse registration order) for stage 2's overlapped reduce-scatters, one per module for
stage 3's gather-before-use.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


# --8<-- [start:layout]
class FlatUnit:
    """Parameters laid out in one padded flat buffer, cut into `world_size` equal shards."""

    def __init__(self, params: Sequence[torch.Tensor], world_size: int, rank: int):
        if not params:
            raise ValueError("FlatUnit needs at least one parameter")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"a FlatUnit holds one dtype on one device, got {dtypes} on {devices}")
        self.params = list(params)
        self.world_size, self.rank = world_size, rank
        # Shapes are recorded once: stage 3 swaps a freed parameter's data for an empty tensor,
        # so p.shape is not always the parameter's real shape.
        self.shapes = [p.shape for p in self.params]
        self.offsets = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.shard_numel = -(-total // world_size)  # ceil
        self.padded_numel = self.shard_numel * world_size
        self.dtype, self.device = params[0].dtype, params[0].device
        # the group it is reduced, sharded and gathered over, and the ranks its gradient is averaged
        # over (ShardedOptimizer sets both: its own group, or an expert shard's: zero/optimizer.py)
        self.process_group, self.mean_over = None, world_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard_range(self, rank: int | None = None) -> tuple[int, int]:
        r = self.rank if rank is None else rank
        return r * self.shard_numel, (r + 1) * self.shard_numel
    # --8<-- [end:layout]

    def empty_flat(self) -> torch.Tensor:
        return torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)

    def flatten(self, tensors: Sequence[torch.Tensor | None], out: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenate tensors shaped like the params (None -> zeros) into a padded flat buffer."""
        flat = self.empty_flat() if out is None else out
        for t, offset, shape in zip(tensors, self.offsets, self.shapes):
            piece = flat[offset: offset + shape.numel()]
            if t is None:
                piece.zero_()
            else:
                piece.copy_(t.reshape(-1))
        flat[self.numel:].zero_()
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat buffer shaped like each parameter (no copies)."""
        return [flat[o: o + shape.numel()].view(shape) for o, shape in zip(self.offsets, self.shapes)]

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a padded flat buffer (a view)."""
        start, end = self.shard_range()
        return flat[start:end]

    @torch.no_grad()
    def copy_into_params(self, flat: torch.Tensor) -> None:
        for p, v in zip(self.params, self.views(flat)):
            p.copy_(v)


def split_into_units(params: Sequence[torch.Tensor], cap_bytes: int | None, world_size: int, rank: int,
                     *, reverse: bool = False, first_cap_bytes: int | None = None) -> list[FlatUnit]:
    """Cut `params` into FlatUnits of at most `cap_bytes` (None: one unit per dtype/device run).

    `reverse=True` packs the last registered parameters first (the order backward produces
    their gradients), as a gradient bucket should. `first_cap_bytes`: the first unit closes
    once it holds that many bytes (torch DDP's layout: a small first bucket, whose reduction
    starts early in backward; as torch's, the parameter that crosses it still goes in, within
    `cap_bytes`, so the last unit, reduced after backward ends, holds what torch's last bucket does).
    """
    order = list(reversed(params)) if reverse else list(params)
    groups: list[list[torch.Tensor]] = []
    size = 0
    for p in order:
        nbytes = p.numel() * p.element_size()
        current = groups[-1] if groups else None
        first_full = first_cap_bytes is not None and len(groups) == 1 and size >= first_cap_bytes
        if (current is None or first_full or (cap_bytes is not None and size + nbytes > cap_bytes)
                or p.dtype != current[0].dtype or p.device != current[0].device):
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    return [FlatUnit(g, world_size, rank) for g in groups]
