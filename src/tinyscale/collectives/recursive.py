"""Recursive halving/doubling (Rabenseifner) and recursive doubling all-reduce.

Both pair ranks by flipping one bit of their position: partner = position XOR d.

**Recursive halving / doubling** (Rabenseifner 2004; Thakur, Rabenseifner & Gropp 2005).
A reduce-scatter by recursive *halving*, then an all-gather by recursive *doubling*, on
the flat tensor zero-padded to p * c elements (c = ceil(numel / p)):

    halving (d = p/2, p/4, .., 1)          doubling (d = 1, 2, .., p/2)
    keep one half of my segment, send      send my segment, receive the partner's
    the other half to my partner, add      (the neighbouring block of the same size);
    the half it sends me: the segment      the segment doubles each round, until
    halves each round, until I hold one    every rank holds all p chunks.
    fully summed chunk: chunk `position`.

    p = 4:  d=2: r0<->r2, r1<->r3 swap halves    d=1: r0<->r1, r2<->r3 swap chunks
            d=1: r0<->r1, r2<->r3 swap quarters  d=2: r0<->r2, r1<->r3 swap halves

2 log2 p rounds (the tree's latency) and (p-1) * c elements sent per phase, the ring's
2(p-1)/p of the padded payload: it is bandwidth-optimal too.

**Recursive doubling.** Every round the partners swap their *whole* vectors and both add:
log2 p rounds of numel elements each. Fewest rounds of all (latency-optimal for small
messages), but log2 p times the message per rank, so it loses as soon as bandwidth counts.
Both partners compute a + b, and floating-point addition is commutative, so all ranks end
with the same bits.

**Any n, not only powers of two: the fold.** Let p be the largest power of two <= n and
r = n - p. The r "extra" ranks (positions p .. n-1) first send their whole (unpadded)
vector to a partner (position - p), which adds it to its own; the p core ranks run the
algorithm; the partners send the result back. This costs 2 more rounds and numel *
element_size more bytes for the r partners (and the extra ranks send only numel *
element_size): the numbers `tinyscale.collectives.cost` states exactly.

Lesson: lessons/01-collectives.md. Tests: ``pytest tests/collectives -k recursive``.
"""

from __future__ import annotations

import torch

from tinyscale.collectives.p2p import exchange, flat_view, group_position, group_ranks, padded


def largest_power_of_two(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


# --8<-- [start:fold]
def _fold_in(flat: torch.Tensor, ranks: list[int], me: int, group) -> bool:
    """Before the power-of-two part: fold the extra ranks' data into their partners.

    Returns True if this rank is an extra one (it sits out and only waits for the result).
    """
    n, p = len(ranks), largest_power_of_two(len(ranks))
    if me >= p:  # extra: hand my data to my partner, then wait for the result
        exchange(sends=[(flat, ranks[me - p])], group=group)
        return True
    if me < n - p:  # partner of an extra rank: add its data to mine
        incoming = torch.empty_like(flat)
        exchange(recvs=[(incoming, ranks[me + p])], group=group)
        flat += incoming
    return False


def _fold_out(flat: torch.Tensor, ranks: list[int], me: int, group) -> None:
    """After the power-of-two part: partners send the result back to the extra ranks."""
    n, p = len(ranks), largest_power_of_two(len(ranks))
    if me >= p:
        exchange(recvs=[(flat, ranks[me - p])], group=group)
    elif me < n - p:
        exchange(sends=[(flat, ranks[me + p])], group=group)
# --8<-- [end:fold]


# --8<-- [start:halving_doubling]
def _halving_reduce_scatter(buf: torch.Tensor, c: int, ranks: list[int], me: int, group) -> None:
    """In place on `buf` (p * c elements): afterwards chunk `me` holds the sum over the p ranks."""
    seg = lambda a, b: buf[a * c : b * c]  # noqa: E731 - chunks a .. b-1, contiguous
    lo, hi = 0, len(buf) // c
    d = (hi - lo) // 2
    while d >= 1:
        mid = (lo + hi) // 2
        # The bit d of my position decides which half I keep; my partner keeps the other.
        (keep_lo, keep_hi), (give_lo, give_hi) = ((mid, hi), (lo, mid)) if me & d else ((lo, mid), (mid, hi))
        incoming = torch.empty_like(seg(keep_lo, keep_hi))
        exchange(sends=[(seg(give_lo, give_hi), ranks[me ^ d])], recvs=[(incoming, ranks[me ^ d])], group=group)
        seg(keep_lo, keep_hi).add_(incoming)
        lo, hi, d = keep_lo, keep_hi, d // 2


def _doubling_all_gather(buf: torch.Tensor, c: int, ranks: list[int], me: int, group) -> None:
    """In place on `buf` (p * c elements): chunk i of rank i goes to chunk i of every rank."""
    seg = lambda a, b: buf[a * c : b * c]  # noqa: E731
    p, lo, d = len(buf) // c, me, 1
    while d < p:
        other = lo ^ d  # the partner's block: the same size as mine, the neighbouring one
        exchange(sends=[(seg(lo, lo + d), ranks[me ^ d])], recvs=[(seg(other, other + d), ranks[me ^ d])],
                 group=group)
        lo, d = min(lo, other), 2 * d
# --8<-- [end:halving_doubling]


# --8<-- [start:recursive_halving_doubling_all_reduce]
def recursive_halving_doubling_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In place: `tensor` (any shape, contiguous) becomes the sum over the group. Returns it."""
    flat = flat_view(tensor, "recursive_halving_doubling_all_reduce")
    ranks, me = group_ranks(group), group_position(group)
    if flat.numel() == 0 or len(ranks) == 1:
        return tensor
    if not _fold_in(flat, ranks, me, group):
        core = ranks[: largest_power_of_two(len(ranks))]
        buf = padded(flat, len(core))  # p * c elements, c = ceil(numel / p)
        c = len(buf) // len(core)
        _halving_reduce_scatter(buf, c, core, me, group)
        _doubling_all_gather(buf, c, core, me, group)
        if buf is not flat:
            flat.copy_(buf[: flat.numel()])
    _fold_out(flat, ranks, me, group)
    return tensor
# --8<-- [end:recursive_halving_doubling_all_reduce]


# --8<-- [start:recursive_doubling_all_reduce]
def recursive_doubling_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In place: `tensor` (any shape, contiguous) becomes the sum over the group. Returns it."""
    flat = flat_view(tensor, "recursive_doubling_all_reduce")
    ranks, me = group_ranks(group), group_position(group)
    if flat.numel() == 0 or len(ranks) == 1:
        return tensor
    if not _fold_in(flat, ranks, me, group):
        p, d = largest_power_of_two(len(ranks)), 1
        incoming = torch.empty_like(flat)
        while d < p:
            partner = ranks[me ^ d]
            exchange(sends=[(flat, partner)], recvs=[(incoming, partner)], group=group)
            flat += incoming  # my partner computes incoming + flat: the same bits
            d *= 2
    _fold_out(flat, ranks, me, group)
    return tensor
# --8<-- [end:recursive_doubling_all_reduce]
