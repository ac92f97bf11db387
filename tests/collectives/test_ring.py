"""The ring's own properties: its two halves against torch's, and its traffic pattern.

(The properties every all-reduce shares, the ring included, are in test_allreduce.py.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import example, given
from hypothesis import strategies as st

from tinyscale.collectives import (
    ring_all_gather,
    ring_all_gather_cost,
    ring_all_reduce,
    ring_cost,
    ring_reduce_scatter,
    ring_reduce_scatter_cost,
)
from tinyscale.dist import comm
from tinyscale.testing import run_on_ranks

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def _reduce_scatter(numel, dtype_name):
    dtype, rank, n = DTYPES[dtype_name], dist.get_rank(), dist.get_world_size()
    x = torch.arange(numel, dtype=dtype) * (rank + 1) + rank  # exact in float32 too
    before = x.clone()
    with comm.record() as ledger:
        mine = ring_reduce_scatter(x, group=None)
    # torch's version: on a divisible input the same call; otherwise our chunk of the full sum.
    c = -(-numel // n)
    reference = torch.zeros(n * c, dtype=dtype)
    reference[:numel] = x
    comm.all_reduce(reference)
    torch_rs = None
    if numel % n == 0 and numel > 0:
        torch_rs = torch.empty(numel // n, dtype=dtype)
        comm.reduce_scatter(torch_rs, x.clone())
    return mine, reference[rank * c:(rank + 1) * c], torch_rs, torch.equal(x, before), ledger.bytes("isend")


@given(world_size=st.sampled_from([2, 3, 4]), numel=st.integers(0, 50), dtype_name=st.sampled_from(sorted(DTYPES)))
@example(world_size=4, numel=1, dtype_name="float64")
@example(world_size=3, numel=0, dtype_name="float32")
def test_ring_allreduce_reduce_scatter_half_matches_torch(world_size, numel, dtype_name):
    cost = ring_reduce_scatter_cost(numel, DTYPES[dtype_name].itemsize, world_size)
    for rank, (mine, expected, torch_rs, untouched, sent) in enumerate(
            run_on_ranks(_reduce_scatter, world_size, numel, dtype_name)):
        assert torch.equal(mine, expected)  # integers in floats: every order sums exactly
        if torch_rs is not None:
            assert torch.equal(mine, torch_rs)
        assert untouched, "ring_reduce_scatter must not modify its input"
        assert sent == cost.bytes_sent[rank]


def _all_gather(numel, dtype_name, in_place):
    dtype, rank, n = DTYPES[dtype_name], dist.get_rank(), dist.get_world_size()
    shard = torch.arange(numel, dtype=dtype) + 100 * rank
    output = torch.full((n * numel,), -1.0, dtype=dtype)
    if in_place:  # the shard already sits in its slot of the output (how all-reduce uses it)
        output[rank * numel:(rank + 1) * numel] = shard
        shard = output[rank * numel:(rank + 1) * numel]
    with comm.record() as ledger:
        ring_all_gather(output, shard)
    expected = torch.empty(n * numel, dtype=dtype)
    comm.all_gather(expected, shard.clone())
    return output, expected, ledger.bytes("isend")


@given(world_size=st.sampled_from([2, 3, 4]), numel=st.integers(0, 20), dtype_name=st.sampled_from(sorted(DTYPES)),
       in_place=st.booleans())
@example(world_size=3, numel=0, dtype_name="float64", in_place=False)
def test_ring_allreduce_all_gather_half_matches_torch(world_size, numel, dtype_name, in_place):
    cost = ring_all_gather_cost(numel, DTYPES[dtype_name].itemsize, world_size)
    for rank, (output, expected, sent) in enumerate(
            run_on_ranks(_all_gather, world_size, numel, dtype_name, in_place)):
        assert torch.equal(output, expected)
        assert sent == cost.bytes_sent[rank]


def _traffic(numel):
    with comm.record() as ledger:
        ring_all_reduce(torch.ones(numel))
    try:
        ring_all_gather(torch.empty(5), torch.ones(2))  # 5 != world_size * 2
        bad_size = None
    except ValueError as err:
        bad_size = str(err)
    return [(r.op, r.peer, r.bytes) for r in ledger.rows], bad_size


def test_ring_allreduce_each_round_sends_one_chunk_to_the_right_neighbour():
    n, numel = 4, 10  # not divisible: chunks of 3 elements, 2 of padding
    for rank, (rows, bad_size) in enumerate(run_on_ranks(_traffic, n, numel)):
        sends = [(peer, nbytes) for op, peer, nbytes in rows if op == "isend"]
        recvs = [(peer, nbytes) for op, peer, nbytes in rows if op == "irecv"]
        # 2(n-1) rounds, each one chunk of ceil(10/4) = 3 floats to the right and from the left.
        assert sends == [((rank + 1) % n, 3 * 4)] * (2 * (n - 1))
        assert recvs == [((rank - 1) % n, 3 * 4)] * (2 * (n - 1))
        assert "needs group size 4 x input's 2 = 8" in bad_size


@given(world_size=st.integers(1, 64), numel=st.integers(0, 10_000), element_size=st.sampled_from([1, 2, 4, 8]))
def test_ring_allreduce_sends_2_n_minus_1_over_n_of_the_padded_payload(world_size, numel, element_size):
    n = world_size
    cost = ring_cost(numel, element_size, n)
    padded_numel = -(-numel // n) * n  # padded to a multiple of n; the padding is sent too
    expected = 0 if numel == 0 or n == 1 else 2 * (n - 1) * padded_numel * element_size // n
    assert cost.bytes_sent == (expected,) * n
    assert cost.steps == (0 if numel == 0 or n == 1 else 2 * (n - 1))
    # Padding is less than one element per chunk: at most 2(n-1) elements more than 2(n-1)/n numel.
    assert 0 <= expected - 2 * (n - 1) * numel * element_size / n < 2 * (n - 1) * element_size or expected == 0
    # An all-reduce is a reduce-scatter and then an all-gather of the chunk.
    assert cost == ring_reduce_scatter_cost(numel, element_size, n) + ring_all_gather_cost(
        padded_numel // n, element_size, n)
