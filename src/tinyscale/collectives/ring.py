"""Ring all-reduce: a reduce-scatter around the ring, then an all-gather around it.

The bandwidth-optimal all-reduce (Patarasuk & Yuan, 2009; what NCCL's "Ring" runs, and
Baidu's allreduce before it). The n ranks of the group sit in a ring; rank i sends only
to i+1 and receives only from i-1. The flat tensor is cut into n equal chunks (padded
with zeros at the end to n * c elements, c = ceil(numel / n)):

    reduce-scatter, n-1 steps          after it, rank i holds the full sum of chunk i
    all-gather,     n-1 steps          after it, every rank holds every summed chunk

Reduce-scatter on 3 ranks (a_i: rank i's data for chunk a; each arrow is one chunk):

             chunk a     chunk b     chunk c
    step 0   r1 -> r2    r2 -> r0    r0 -> r1      each rank sends the chunk "behind" it
    step 1   r2 -> r0    r0 -> r1    r1 -> r2      and adds what it receives to its own
    result   r0: a0+a1+a2   r1: b0+b1+b2   r2: c0+c1+c2

At step k rank i sends chunk (i-k-1) mod n to i+1 and adds chunk (i-k-2) mod n from i-1;
so the last chunk it completes is chunk i, and rank i owns chunk i, the same layout as
`torch.distributed.reduce_scatter_tensor`. The all-gather then passes completed chunks
around: at step k rank i sends chunk (i-k) mod n and stores chunk (i-k-1) mod n.

Cost, per rank: 2(n-1) rounds, each sending one chunk of c elements, so
2(n-1) * c * element_size bytes = 2(n-1)/n of the *padded* payload n * c * element_size.
Padding adds at most n-1 elements to the payload (less than one element per chunk).
Every rank sends the same amount, which is why no link is a bottleneck.

Lesson: lessons/01-collectives.md. Tests: ``pytest tests/collectives -k ring_allreduce``.
"""

from __future__ import annotations

import torch

from tinyscale.collectives.p2p import exchange, flat_view, group_position, group_ranks, padded


# --8<-- [start:reduce_scatter_steps]
def _reduce_scatter_chunks(chunks: torch.Tensor, group) -> None:
    """In place on `chunks` (n, c): afterwards row i of rank i holds the sum over ranks of row i."""
    ranks, me = group_ranks(group), group_position(group)
    n = len(ranks)
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    incoming = torch.empty_like(chunks[0])  # (c,)
    for step in range(n - 1):
        send, recv = (me - step - 1) % n, (me - step - 2) % n
        exchange(sends=[(chunks[send], right)], recvs=[(incoming, left)], group=group)
        chunks[recv] += incoming  # left's partial sum of this chunk, plus mine
# --8<-- [end:reduce_scatter_steps]


# --8<-- [start:all_gather_steps]
def _all_gather_chunks(chunks: torch.Tensor, group) -> None:
    """In place on `chunks` (n, c): row i of rank i goes to row i of every rank."""
    ranks, me = group_ranks(group), group_position(group)
    n = len(ranks)
    right, left = ranks[(me + 1) % n], ranks[(me - 1) % n]
    for step in range(n - 1):
        send, recv = (me - step) % n, (me - step - 1) % n
        # Receive straight into place: the chunk we store now is the one we pass on next step.
        exchange(sends=[(chunks[send], right)], recvs=[(chunks[recv], left)], group=group)
# --8<-- [end:all_gather_steps]


def ring_reduce_scatter(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's chunk of the sum over the group of `tensor` (any shape, flattened).

    Chunk i is elements ``[i*c, (i+1)*c)`` of the flat tensor zero-padded to ``n*c``
    elements, ``c = ceil(numel / n)``; it may end in padding (zeros summed: zeros).
    Returns a view into a new padded buffer; `tensor` is not modified. When numel divides
    by n this equals ``torch.distributed.reduce_scatter_tensor``'s output.
    """
    flat = flat_view(tensor, "ring_reduce_scatter")
    n = len(group_ranks(group))
    c = -(-flat.numel() // n)
    buf = flat.new_zeros(n * c)
    buf[: flat.numel()] = flat
    chunks = buf.view(n, c)  # (n, c): row i is chunk i
    if c > 0 and n > 1:
        _reduce_scatter_chunks(chunks, group)
    return chunks[group_position(group)]


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    """Fill `output` (n * input.numel() elements) with every rank's `input`, in group order.

    `input` may be a view of this rank's own slot in `output` (then nothing is copied).
    Sends (n-1) * input.numel() * element_size bytes per rank in n-1 rounds.
    """
    out = flat_view(output, "ring_all_gather")
    shard = flat_view(input, "ring_all_gather")
    n, me = len(group_ranks(group)), group_position(group)
    if out.numel() != n * shard.numel():
        raise ValueError(
            f"ring_all_gather: output has {out.numel()} elements but needs group size {n} x "
            f"input's {shard.numel()} = {n * shard.numel()}"
        )
    chunks = out.view(n, shard.numel())  # (n, k): row i is rank i's input
    if shard.numel() == 0:
        return output
    if chunks[me].data_ptr() != shard.data_ptr():
        chunks[me].copy_(shard)
    if n > 1:
        _all_gather_chunks(chunks, group)
    return output


# --8<-- [start:ring_all_reduce]
def ring_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In place: `tensor` (any shape, contiguous) becomes the sum over the group. Returns it."""
    flat = flat_view(tensor, "ring_all_reduce")
    n = len(group_ranks(group))
    if flat.numel() == 0 or n == 1:
        return tensor
    buf = padded(flat, n)  # flat itself when numel divides by n, else a zero-padded copy
    chunks = buf.view(n, -1)  # (n, c): row i is chunk i
    _reduce_scatter_chunks(chunks, group)  # rank i now owns the summed chunk i
    _all_gather_chunks(chunks, group)  # and now every rank has every summed chunk
    if buf is not flat:
        flat.copy_(buf[: flat.numel()])
    return tensor
# --8<-- [end:ring_all_reduce]
