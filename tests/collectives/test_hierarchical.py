"""Two-level all-reduce on 4 ranks pretending to be nodes: equal to the flat one, fewer bytes between nodes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given
from hypothesis import strategies as st

from tinyscale.collectives import (
    hierarchical_all_reduce,
    hierarchical_cost,
    hierarchical_phase_costs,
    measured_steps,
    node_groups,
    node_layout,
    ring_all_reduce,
    ring_cost,
)
from tinyscale.dist import comm
from tinyscale.testing import run_on_ranks

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def _crossing(rows, ranks_per_node):
    """Bytes this rank sent to ranks on other nodes (node of rank r: r // ranks_per_node)."""
    me = dist.get_rank() // ranks_per_node
    return sum(r.bytes for r in rows if r.op == "isend" and r.peer // ranks_per_node != me)


def _hierarchical(ranks_per_node, numel, dtype_name):
    dtype, rank = DTYPES[dtype_name], dist.get_rank()
    intra, inter = node_groups(ranks_per_node)
    x = torch.arange(numel, dtype=dtype) * (rank + 1) - rank  # small integers: every order sums exactly
    expected = x.clone()
    comm.all_reduce(expected)
    with comm.record() as ledger:
        hierarchical_all_reduce(x, intra_group=intra, inter_group=inter)
    return x, expected, ledger.rows, ledger.bytes("isend"), _crossing(ledger.rows, ranks_per_node)


@given(ranks_per_node=st.sampled_from([1, 2, 4]), numel=st.integers(0, 50),
       dtype_name=st.sampled_from(sorted(DTYPES)))
@example(ranks_per_node=2, numel=1, dtype_name="float64")
@example(ranks_per_node=2, numel=7, dtype_name="float32")
def test_hierarchical_allreduce_equals_flat_and_its_cost_model(ranks_per_node, numel, dtype_name):
    # 4 ranks as 4 nodes of 1, 2 nodes of 2, or 1 node of 4.
    n, size = 4, DTYPES[dtype_name].itemsize
    results = run_on_ranks(_hierarchical, n, ranks_per_node, numel, dtype_name)
    cost = hierarchical_cost(numel, size, n, ranks_per_node)
    inter = hierarchical_phase_costs(numel, size, n, ranks_per_node)["inter_all_reduce"]
    for rank, (x, expected, _, sent, crossing) in enumerate(results):
        assert torch.equal(x, expected)
        assert sent == cost.bytes_sent[rank]
        assert crossing == inter.bytes_sent[rank // ranks_per_node]  # only phase 2 leaves the node
    assert measured_steps([rows for _, _, rows, _, _ in results]) == cost.steps


def _flat_ring(ranks_per_node, numel):
    x = torch.ones(numel)
    with comm.record() as ledger:
        ring_all_reduce(x)
    return _crossing(ledger.rows, ranks_per_node)


def test_hierarchical_allreduce_sends_1_over_g_of_the_message_between_nodes():
    # 2 nodes x 2 ranks; 1200 float32 = 4800 bytes, divisible by everything in sight.
    g, m, numel, size = 2, 2, 1200, 4
    n, message = g * m, 1200 * 4
    hier = [crossing for *_, crossing in run_on_ranks(_hierarchical, n, g, numel, "float32")]
    flat = run_on_ranks(_flat_ring, n, g, numel)

    # Two-level: every rank sends 2(M-1)/M of its 1/G shard across: a ring all-reduce
    # across nodes of 1/G of the message (the whole point).
    assert hier == [2 * (m - 1) * message // (m * g)] * n == [2400] * 4
    assert hier[0] * g == ring_cost(numel, size, m).bytes_sent[0]
    # Flat ring (order r0 r1 | r2 r3): only r1 -> r2 and r3 -> r0 cross, each carrying all
    # 2(n-1)/n of the message over one link; the others stay inside their node.
    assert flat == [0, 2 * (n - 1) * message // n, 0, 2 * (n - 1) * message // n] == [0, 7200, 0, 7200]
    # So the busiest inter-node sender carries 1/3 as much, and each node puts 2/3 as many
    # bytes on the inter-node network (4800 vs 7200), spread over G links instead of one.
    assert max(hier) * 3 == max(flat)
    assert [sum(hier[k * g:(k + 1) * g]) for k in range(m)] == [4800, 4800]


@given(world_size=st.integers(1, 64), ranks_per_node=st.integers(1, 64))
def test_hierarchical_node_layout_puts_every_rank_in_one_group_of_each_kind(world_size, ranks_per_node):
    if world_size % ranks_per_node:
        with pytest.raises(ValueError, match="must be a positive divisor"):
            node_layout(world_size, ranks_per_node)
        return
    intra, inter = node_layout(world_size, ranks_per_node)
    for layout in (intra, inter):
        assert sorted(r for group in layout for r in group) == list(range(world_size))
    for rank in range(world_size):
        (my_node,) = [gr for gr in intra if rank in gr]
        (my_peers,) = [gr for gr in inter if rank in gr]
        # A node is a run of consecutive ranks; the inter group is one rank per node, same local rank.
        assert my_node == list(range(rank - rank % ranks_per_node, rank - rank % ranks_per_node + ranks_per_node))
        assert set(my_node) & set(my_peers) == {rank}
        assert {r % ranks_per_node for r in my_peers} == {rank % ranks_per_node}


@pytest.mark.parametrize("ranks_per_node", [2, 3])
def test_hierarchical_allreduce_on_six_ranks(ranks_per_node):
    # 3 nodes of 2 and 2 nodes of 3: padding at both levels (13 elements), an odd inter ring.
    n, numel = 6, 13
    results = run_on_ranks(_hierarchical, n, ranks_per_node, numel, "float64")
    cost = hierarchical_cost(numel, 8, n, ranks_per_node)
    inter = hierarchical_phase_costs(numel, 8, n, ranks_per_node)["inter_all_reduce"]
    for rank, (x, expected, _, sent, crossing) in enumerate(results):
        assert torch.equal(x, expected)
        assert (sent, crossing) == (cost.bytes_sent[rank], inter.bytes_sent[rank // ranks_per_node])
    assert measured_steps([rows for _, _, rows, _, _ in results]) == cost.steps
