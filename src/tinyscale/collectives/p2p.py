"""The one primitive every algorithm in this package is made of: a *round* of messages.

Each all-reduce here is a schedule of rounds. In one round a rank posts some sends and
some receives, all at once, and waits until all of them are done:

    exchange(sends=[(chunk, right)], recvs=[(incoming, left)], group=group)

Every message goes through `tinyscale.dist.comm` (``batch_isend_irecv``), so a ledger
sees each one as an ``isend`` row (bytes this rank put on the wire) or an ``irecv`` row
(bytes it took off), with the peer's global rank. Rows of one round share their start
time, which is how `tinyscale.collectives.cost.measured_steps` finds the rounds again.

Peers are *global* ranks (what torch's point-to-point calls take, whatever the group),
while the algorithms think in positions inside the group (0 .. n-1). `group_ranks` is
the bridge: ``group_ranks(group)[i]`` is the global rank at group position ``i``.

Lesson: lessons/01-collectives.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from tinyscale.dist import comm


def group_ranks(group=None) -> list[int]:
    """Global ranks of `group` (None: the world), in group order."""
    return dist.get_process_group_ranks(dist.group.WORLD if group is None else group)


def group_position(group=None) -> int:
    """This rank's position in `group` (0 .. size-1)."""
    return dist.get_rank(group)


def flat_view(tensor: torch.Tensor, who: str) -> torch.Tensor:
    """A 1-D view of `tensor` (any shape), so that writing to it writes to `tensor`.

    A copy would silently lose the in-place result, so a non-contiguous tensor is refused.
    """
    if not tensor.is_contiguous():
        raise ValueError(
            f"{who}: the tensor must be contiguous (shape {tuple(tensor.shape)}, strides "
            f"{tensor.stride()}) because the result is written in place; pass "
            "tensor.contiguous() and use the returned copy"
        )
    return tensor.view(-1)


def padded(flat: torch.Tensor, multiple: int) -> torch.Tensor:
    """`flat` itself if its length is a multiple of `multiple`, else a zero-padded copy.

    Padding goes at the end, so ``padded(flat, n)[:flat.numel()]`` is always the data.
    """
    numel = flat.numel()
    length = -(-numel // multiple) * multiple  # ceil(numel / multiple) * multiple
    if length == numel:
        return flat
    buf = flat.new_zeros(length)
    buf[:numel] = flat
    return buf


# --8<-- [start:exchange]
def exchange(
    sends: Sequence[tuple[torch.Tensor, int]] = (),
    recvs: Sequence[tuple[torch.Tensor, int]] = (),
    group=None,
) -> None:
    """One round: send each ``(tensor, global_peer)`` in `sends`, fill each in `recvs`, wait for all.

    Sends and receives are posted together, never "send, then receive": if a send only
    completes once the peer has posted the matching receive (always so on NCCL, and on
    MPI or gloo for large messages), a ring of ranks that all send first waits forever,
    every rank stuck in its send to a neighbour that is stuck in its own.
    """
    ops = [comm.P2POp("isend", t, peer, group) for t, peer in sends]
    ops += [comm.P2POp("irecv", t, peer, group) for t, peer in recvs]
    for work in comm.batch_isend_irecv(ops):
        work.wait()  # also the sends: their buffers may be overwritten once this returns
# --8<-- [end:exchange]
