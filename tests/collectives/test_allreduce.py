"""Every all-reduce, through the seam, held to the same properties.

Interface (tinyscale.collectives): ``fn(tensor, group=None)`` sums `tensor` (any shape,
contiguous, any numel including 0) over `group` in place and returns it. A learner's
version joins with ``TINYSCALE_IMPL_ALL_REDUCE=my_allreduce.py:all_reduce`` (and its bytes
and rounds are checked too with ``TINYSCALE_ALL_REDUCE_COST=ring``, or another key of COSTS).

The ids carry the algorithm and the key, so ``pytest -k ring_allreduce`` selects the ring,
``-k tree_allreduce`` the tree, ``-k allreduce`` all of them.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given
from hypothesis import strategies as st

from tinyscale.collectives import ALL_REDUCE, COSTS, measured_steps
from tinyscale.dist import comm
from tinyscale.testing import implementations, resolve, run_on_ranks

ALGORITHMS = implementations("all_reduce", {f"{name}_allreduce": spec for name, spec in ALL_REDUCE.items()})
COST_OF = {spec: COSTS[name] for name, spec in ALL_REDUCE.items()}
# A learner's version is held to the cost model of the algorithm it implements, if named:
# TINYSCALE_ALL_REDUCE_COST=ring (a key of tinyscale.collectives.COSTS).
if os.environ.get("TINYSCALE_IMPL_ALL_REDUCE") and os.environ.get("TINYSCALE_ALL_REDUCE_COST"):
    COST_OF[os.environ["TINYSCALE_IMPL_ALL_REDUCE"]] = COSTS[os.environ["TINYSCALE_ALL_REDUCE_COST"]]
DTYPES = {"float64": torch.float64, "float32": torch.float32}


@st.composite
def shapes(draw) -> tuple[int, ...]:
    """numel 0..50 (0, 1 and sizes no world size divides), as a vector or a matrix."""
    numel = draw(st.integers(0, 50))
    if draw(st.booleans()):
        return (numel,)
    rows = draw(st.sampled_from([d for d in range(1, numel + 1) if numel % d == 0] or [3]))
    return (rows, numel // rows)


def inputs(shape, dtype_name, seed, rank) -> torch.Tensor:
    """Rank `rank`'s input: the same on the ranks and in the test process."""
    numel = 1
    for d in shape:
        numel *= d
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(DTYPES[dtype_name]).view(shape)


def _run(impl, shape, dtype_name, seed):
    """Run the algorithm and torch's all-reduce on the same input; return both and the ledger."""
    all_reduce = resolve(impl)
    x = inputs(shape, dtype_name, seed, dist.get_rank())
    expected = x.clone()
    comm.all_reduce(expected)  # gloo's (or NCCL's) own, outside the ledger below
    address = x.data_ptr()
    with comm.record() as ledger:
        out = all_reduce(x)
    in_place = out is x and x.data_ptr() == address and x.shape == shape
    return x, expected, in_place, ledger.rows


def _float32_bound(shape, seed, world_size) -> torch.Tensor:
    """|error| of any summation order of n float32 values <= (n-1) * eps * sum |x_i|, elementwise."""
    total_abs = sum(inputs(shape, "float32", seed, r).double().abs() for r in range(world_size))
    return (world_size - 1) * torch.finfo(torch.float32).eps * total_abs


@pytest.mark.parametrize("impl", ALGORITHMS)
@given(world_size=st.sampled_from([2, 3, 4]), shape=shapes(), dtype_name=st.sampled_from(sorted(DTYPES)),
       seed=st.integers(0, 10_000))
@example(world_size=3, shape=(0,), dtype_name="float64", seed=0)
@example(world_size=4, shape=(1,), dtype_name="float32", seed=1)
def test_allreduce_matches_torch_on_every_rank(impl, world_size, shape, dtype_name, seed):
    results = run_on_ranks(_run, world_size, impl, shape, dtype_name, seed)
    for rank, (got, expected, in_place, _) in enumerate(results):
        assert in_place, f"rank {rank}: the result must be written into the given tensor"
        if dtype_name == "float64":
            # Summing <= 4 values of size ~1 in two orders differs by ~1e-15: 1e-12 leaves no room for a bug.
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        else:
            # Both orders are within (n-1) eps sum|x| of the exact sum, so within twice that of each other.
            bound = 2 * _float32_bound(shape, seed, world_size)
            assert ((got.double() - expected.double()).abs() <= bound).all(), (got, expected)
        # Replicas must stay identical: every rank ends with the same bits.
        assert torch.equal(got, results[0][0]), f"rank {rank} differs from rank 0"


@pytest.mark.parametrize("impl", ALGORITHMS)
@given(world_size=st.sampled_from([2, 3, 4]), numel=st.integers(0, 50), dtype_name=st.sampled_from(sorted(DTYPES)))
@example(world_size=3, numel=1, dtype_name="float64")
@example(world_size=4, numel=7, dtype_name="float32")
def test_allreduce_bytes_and_steps_equal_the_cost_model(impl, world_size, numel, dtype_name):
    if impl not in COST_OF:
        pytest.skip("no cost model for this implementation: compare its ledger with your own formula")
    results = run_on_ranks(_run, world_size, impl, (numel,), dtype_name, 0)
    rows_by_rank = [rows for *_, rows in results]
    cost = COST_OF[impl](numel, DTYPES[dtype_name].itemsize, world_size)
    for rank, rows in enumerate(rows_by_rank):
        ledger = comm.Ledger(rows)
        # Only point-to-point messages: a hidden collective would bypass the algorithm.
        assert {r.op for r in rows} <= {"isend", "irecv"}, {r.op for r in rows}
        assert {r.group_size for r in rows} <= {world_size}
        # "Sent" is every isend (and send) row: the bytes this rank put on the wire.
        assert ledger.bytes(("isend", "send")) == cost.bytes_sent[rank], f"rank {rank}"
    sent = sum(comm.Ledger(rows).bytes("isend") for rows in rows_by_rank)
    received = sum(comm.Ledger(rows).bytes("irecv") for rows in rows_by_rank)
    assert sent == received  # every byte sent was received by someone
    assert measured_steps(rows_by_rank) == cost.steps


# Module-level, so each rank process keeps its groups between tests (creating one is a
# collective over the world: every rank creates every group, in the same order).
_groups: dict[tuple[int, ...], object] = {}


def _run_on_subgroup(impl, members, numel):
    """The members of `members` (global ranks) all-reduce among themselves; the others sit out."""
    if members not in _groups:
        _groups[members] = dist.new_group(list(members))
    rank = dist.get_rank()
    x = torch.full((numel,), float(rank + 1), dtype=torch.float64)
    with comm.record() as ledger:
        if rank in members:
            resolve(impl)(x, group=_groups[members])
    return x, ledger.bytes("isend"), {r.peer for r in ledger.rows}


@pytest.mark.parametrize("impl", ALGORITHMS)
def test_allreduce_on_a_subgroup_talks_only_to_its_members(impl):
    # Group positions 0, 1, 2 are global ranks 1, 2, 3: a mix-up between the two shows here.
    members, numel = (1, 2, 3), 11
    results = run_on_ranks(_run_on_subgroup, 4, impl, members, numel)
    total = float(sum(r + 1 for r in members))
    for rank, (x, sent, peers) in enumerate(results):
        if rank in members:
            assert x.tolist() == [total] * numel
            assert peers <= set(members) - {rank}
            if impl in COST_OF:
                assert sent == COST_OF[impl](numel, 8, len(members)).bytes_sent[members.index(rank)]
        else:
            assert x.tolist() == [float(rank + 1)] * numel and sent == 0


@pytest.mark.parametrize("impl", ALGORITHMS)
def test_allreduce_refuses_a_non_contiguous_tensor(impl):
    # A transposed matrix has no flat view; summing a copy would silently lose the result.
    with pytest.raises(ValueError, match="contiguous"):
        resolve(impl)(torch.zeros(3, 4).t())


def _six_ranks(impl, numel):
    x = torch.arange(numel, dtype=torch.float64) * (dist.get_rank() + 1)
    with comm.record() as ledger:
        resolve(impl)(x)
    return x, ledger.rows


@pytest.mark.parametrize("impl", ALGORITHMS)
def test_allreduce_on_six_ranks(impl):
    # Six ranks reach what 2-4 cannot: a fold of two extra ranks (p=4, r=2) and tree nodes
    # that have a parent and two children. One example, no hypothesis: a 6-rank pool is slow.
    n, numel = 6, 13
    results = run_on_ranks(_six_ranks, n, impl, numel)
    expected = torch.arange(numel, dtype=torch.float64) * sum(range(1, n + 1))
    for x, _ in results:
        assert torch.equal(x, expected)
    if impl in COST_OF:
        cost = COST_OF[impl](numel, 8, n)
        assert tuple(comm.Ledger(rows).bytes("isend") for _, rows in results) == cost.bytes_sent
        assert measured_steps([rows for _, rows in results]) == cost.steps
