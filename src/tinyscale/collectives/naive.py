r"""Naive all-reduce: everyone sends to a root, the root sums and sends the sum back.

The version one writes first, and the baseline the others are measured against. The root
is group position 0.

            reduce (round 1)                 broadcast (round 2)
      r1 --x1--\                               /--sum--> r1
      r2 --x2---> r0: sum = x0+x1+x2+x3  r0 ---+--sum--> r2
      r3 --x3--/                               \--sum--> r3

Cost: 2 rounds. A non-root rank sends numel * element_size bytes (its data, once); the
root sends (n-1) * numel * element_size (the sum, to each rank) and receives as much.
Nothing is padded. The root's one link takes those 2(n-1) messages one after another
while every other link idles: 2(n-1)(alpha + S beta) for S bytes, linear in n, which is
the whole reason for the ring.

Lesson: lessons/01-collectives.md. Tests: ``pytest tests/collectives -k naive_allreduce``.
"""

from __future__ import annotations

import torch

from tinyscale.collectives.p2p import exchange, flat_view, group_position, group_ranks


# --8<-- [start:naive_all_reduce]
def naive_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In place: `tensor` (any shape, contiguous) becomes the sum over the group. Returns it."""
    flat = flat_view(tensor, "naive_all_reduce")
    ranks, me = group_ranks(group), group_position(group)
    if flat.numel() == 0 or len(ranks) == 1:
        return tensor
    root = ranks[0]
    if me == 0:
        # Post every receive at once, into separate buffers: whichever rank is ready first
        # is served first. Then sum in group order, so the bits never depend on timing.
        incoming = [torch.empty_like(flat) for _ in ranks[1:]]
        exchange(recvs=list(zip(incoming, ranks[1:])), group=group)
        for x in incoming:
            flat += x
        exchange(sends=[(flat, peer) for peer in ranks[1:]], group=group)
    else:
        exchange(sends=[(flat, root)], group=group)
        exchange(recvs=[(flat, root)], group=group)  # the send above is done: safe to overwrite
    return tensor
# --8<-- [end:naive_all_reduce]
