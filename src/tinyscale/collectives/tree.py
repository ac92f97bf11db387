r"""Binary-tree all-reduce: sum up a binary tree to the root, then broadcast back down.

The group's positions form a binary heap: position i's children are 2i+1 and 2i+2, its
parent (i-1) // 2. A node waits for its children's partial sums, adds them to its own
data and sends the result to its parent; the root then holds the total and sends it back
down the same edges.

                 r0                   depth 0      reduce: leaves -> root, D rounds
               /    \
             r1      r2               depth 1      broadcast: root -> leaves, D rounds
            /  \    /
          r3    r4  r5                depth 2      D = floor(log2 n), the heap's depth

Cost: 2 floor(log2 n) rounds on the critical path (the latency win over the ring's
2(n-1)), but every hop carries the whole message, unpadded: position i sends
numel * element_size to its parent (if it has one) plus as much to each child. So a leaf
sends 1x the message, an inner node up to 3x, the root up to 2x, and a node with two
children receives 2x per phase through one link. That is why a plain tree loses to the
ring on large messages; NCCL's trees pipeline the message in small chunks through two
complementary trees to win back the bandwidth.

Lesson: lessons/01-collectives.md. Tests: ``pytest tests/collectives -k tree_allreduce``.
"""

from __future__ import annotations

import torch

from tinyscale.collectives.p2p import exchange, flat_view, group_position, group_ranks


def heap_children(position: int, size: int) -> list[int]:
    """Positions of `position`'s children in a binary heap of `size` nodes."""
    return [c for c in (2 * position + 1, 2 * position + 2) if c < size]


# --8<-- [start:tree_all_reduce]
def tree_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In place: `tensor` (any shape, contiguous) becomes the sum over the group. Returns it."""
    flat = flat_view(tensor, "tree_all_reduce")
    ranks, me = group_ranks(group), group_position(group)
    n = len(ranks)
    if flat.numel() == 0 or n == 1:
        return tensor
    children = [ranks[c] for c in heap_children(me, n)]
    parent = ranks[(me - 1) // 2] if me > 0 else None

    # Reduce: the children's partial sums arrive together (one round), then go up as one.
    incoming = [torch.empty_like(flat) for _ in children]
    if children:
        exchange(recvs=list(zip(incoming, children)), group=group)
    for x in incoming:  # left child, then right: a fixed order, so the same bits every run
        flat += x
    if parent is not None:
        exchange(sends=[(flat, parent)], group=group)
        exchange(recvs=[(flat, parent)], group=group)  # broadcast: the total comes back down
    if children:
        exchange(sends=[(flat, child) for child in children], group=group)
    return tensor
# --8<-- [end:tree_all_reduce]
