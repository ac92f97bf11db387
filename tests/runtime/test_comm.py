"""The comm ledger: every wrapper records its op, bytes (as documented), group size and time."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from tinyscale.dist import ParallelMesh, comm
from tinyscale.testing import run_on_ranks

DTYPES = {"float64": torch.float64, "float32": torch.float32, "int64": torch.int64, "bfloat16": torch.bfloat16}


def _every_op(numel, dtype_name):
    dtype = DTYPES[dtype_name]
    rank, n = dist.get_rank(), dist.get_world_size()
    size = torch.tensor([], dtype=dtype).element_size()
    x = torch.full((numel,), rank + 1, dtype=dtype)
    with comm.record() as ledger:
        comm.all_reduce(x)
        comm.broadcast(x, src=0)
        gathered = torch.empty(n * numel, dtype=dtype)
        comm.all_gather(gathered, torch.full((numel,), rank, dtype=dtype))
        out = torch.empty(numel, dtype=dtype)
        # chunk c of rank r's input holds (r + 1)(c + 1): a sum that mixes up ranks or chunks shows
        chunk = torch.arange(1, n + 1, dtype=dtype).repeat_interleave(numel)
        comm.reduce_scatter(out, chunk * (rank + 1))
        a2a = torch.empty(n * numel, dtype=dtype)
        comm.all_to_all(a2a, torch.full((n * numel,), rank, dtype=dtype))
        right, left = (rank + 1) % n, (rank - 1) % n
        recv = torch.empty(numel, dtype=dtype)
        works = comm.batch_isend_irecv([comm.P2POp("isend", x, right), comm.P2POp("irecv", recv, left)])
        for w in works:
            w.wait()
        comm.barrier()
    expected = {
        "all_reduce": numel * size,
        "broadcast": numel * size,
        "all_gather": n * numel * size,
        "reduce_scatter": n * numel * size,
        "all_to_all": n * numel * size,
        "isend": numel * size,
        "irecv": numel * size,
        "barrier": 0,
    }
    values = dict(
        all_reduce=x.double().tolist(),
        gathered=gathered.double().tolist(),
        reduce_scatter=out.double().tolist(),
        a2a=a2a.double().tolist(),
    )
    return ({op: ledger.bytes(op) for op in expected}, expected, ledger.calls(), {r.group_size for r in ledger.rows},
            all(r.end is not None for r in ledger.rows), values)


@given(numel=st.integers(0, 33), dtype_name=st.sampled_from(sorted(DTYPES)), world_size=st.sampled_from([2, 3, 4]))
def test_comm_ledger_bytes_equal_tensor_sizes(numel, dtype_name, world_size):
    for rank, (got, expected, calls, group_sizes, all_done, values) in enumerate(
        run_on_ranks(_every_op, world_size, numel, dtype_name)
    ):
        assert got == expected
        assert calls == 8 and group_sizes == {world_size} and all_done
        n = world_size
        total = n * (n + 1) // 2
        assert values["all_reduce"] == [float(total)] * numel
        assert values["gathered"] == [float(r) for r in range(n) for _ in range(numel)]
        assert values["reduce_scatter"] == [float(total * (rank + 1))] * numel  # (1 + .. + n)(rank + 1)
        assert values["a2a"] == [float(r) for r in range(n) for _ in range(numel)]


def test_comm_bus_bytes_follow_the_ring_factors():
    rows = [comm.Row("all_reduce", 1200, 4, "float32", 0.0), comm.Row("all_gather", 1200, 4, "float32", 0.0),
            comm.Row("reduce_scatter", 1200, 3, "float32", 0.0), comm.Row("recv", 100, 2, "float32", 0.0)]
    ledger = comm.Ledger(rows)
    assert ledger.bus_bytes("all_reduce") == 1200 * 2 * 3 / 4
    assert ledger.bus_bytes("all_gather") == 1200 * 3 / 4
    assert ledger.bus_bytes("reduce_scatter") == 1200 * 2 / 3
    assert ledger.bus_bytes("recv") == 0
    assert ledger.by_op()["all_reduce"]["calls"] == 1
    with pytest.raises(ValueError, match="unknown op"):
        ledger.bytes("allreduce")


def _nested_and_grouped():
    mesh = ParallelMesh(dp=2, tp=2)
    rank = dist.get_rank()
    with comm.record() as outer:
        comm.all_reduce(torch.ones(10))
        with comm.record() as inner:
            work = comm.all_reduce(torch.ones(3), group=mesh.group("tp"), async_op=True)
            pending = inner.rows[0].end is None
            work.wait()
        # a dp-axis pair: rank r sends to r + 2 (or receives from r - 2)
        x = torch.ones(2)
        works = comm.batch_isend_irecv([comm.P2POp("isend" if rank < 2 else "irecv", x, (rank + 2) % 4)])
        for w in works:
            w.wait()
    return (outer.calls(), inner.calls(), [r.group_size for r in outer.rows], pending, inner.rows[0].seconds >= 0,
            [r.ranks for r in outer.rows], mesh.group_ranks("tp"))


def test_comm_nested_records_and_async_rows():
    for rank, (outer, inner, sizes, pending, timed, ranks, tp_group) in enumerate(run_on_ranks(_nested_and_grouped,
                                                                                               4)):
        assert (outer, inner, sizes, pending, timed) == (3, 1, [4, 2, 4], True, True)
        pair = (rank, rank + 2) if rank < 2 else (rank - 2, rank)  # (sender, receiver)
        assert ranks == [(0, 1, 2, 3), tuple(tp_group), pair]
        assert tp_group == [rank - rank % 2, rank - rank % 2 + 1]  # tp fastest: consecutive ranks


def test_comm_nested_records_each_close_their_own_ledger():
    # an inner ledger with the same rows as the enclosing one (here both empty) compares equal to it
    with comm.record() as outer:
        with comm.record() as inner:
            assert inner == outer and comm._active[-1] is inner
        assert len(comm._active) == 1 and comm._active[0] is outer
    assert comm._active == []


def _gathers_beside_a_send():
    rank, n = dist.get_rank(), dist.get_world_size()
    # a caller's message on the default tag, posted first and received last: the gathers' own
    # messages must not be matched with it
    note = torch.full((5,), 100.0 + rank)
    sent = comm.isend(note, (rank + 1) % n)
    first, second = torch.empty(3 * n), torch.empty(2 * n)
    a = comm.all_gather(first, torch.full((3,), float(rank)), async_op=True)
    b = comm.all_gather(second, torch.full((2,), 10.0 + rank), async_op=True)
    b.wait()
    a.wait()
    got = torch.empty(5)
    comm.irecv(got, (rank - 1) % n).wait()
    sent.wait()
    return first.tolist(), second.tolist(), got.tolist()


@pytest.mark.parametrize("world_size", [2, 3])
def test_comm_gloo_all_gather_p2p_two_in_flight_and_a_callers_send_stay_apart(world_size):
    """On gloo the all-gather is point-to-point (comm.GLOO_ALL_GATHER_P2P): two in flight at
    once land in order, and a caller's send on the same group is not taken for one of them."""
    assert comm.GLOO_ALL_GATHER_P2P
    for rank, (first, second, got) in enumerate(run_on_ranks(_gathers_beside_a_send, world_size)):
        n = world_size
        assert first == [float(r) for r in range(n) for _ in range(3)]
        assert second == [10.0 + r for r in range(n) for _ in range(2)]
        assert got == [100.0 + (rank - 1) % n] * 5
