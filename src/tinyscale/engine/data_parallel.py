"""The simplest correct data parallelism: all-reduce every gradient, then divide by dp.

One all-reduce per parameter, after the whole backward: nothing overlaps, nothing is
bucketed. `tinyscale.data_parallel` (its own topic) shows what bucketing and overlap buy;
this is the baseline the engine starts from.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tinyscale.dist import comm


@torch.no_grad()
def average_gradients(params: Sequence[torch.nn.Parameter], group, dp_size: int) -> None:
    """Replace each gradient by its mean over the data-parallel group.

    A parameter that got no gradient on this rank (unused in this rank's forward) joins
    with zeros: every rank must issue the same all-reduces in the same order, or they hang.
    """
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        comm.all_reduce(p.grad, group=group)
        p.grad.div_(dp_size)


@torch.no_grad()
def broadcast_parameters(model: torch.nn.Module, src: int, group) -> None:
    """Copy global rank `src`'s parameters and buffers to every rank of `group`."""
    for t in [*model.parameters(), *model.buffers()]:
        comm.broadcast(t.data, src=src, group=group)
