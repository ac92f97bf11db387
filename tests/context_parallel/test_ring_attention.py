"""Ring attention on cp ranks equals attention over the whole sequence (PyTorch's SDPA,
float64): output, LSE, dQ, dK, dV; causal and not, zigzag and contiguous, GQA, lengths that
are not a multiple of the chunk count. The ledger shows the bytes of the formula.
Run: `pytest -k ring_attention`."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.context_parallel.cases import D, dense, gathered, sharded_body
from tinyscale.context_parallel.sharding import Layout
from tinyscale.testing import run_on_ranks

NAMES = ["out", "lse", "dq", "dk", "dv"]


def _check_against_dense(results, T, H, K, seed, sharding, causal):
    expected = dense(T, H, K, seed, causal)
    for name, got, want in zip(NAMES, gathered(results, T, sharding), expected):
        if got is not None:
            # float64: block-wise sums reorder ~T terms, ~1e-15 relative; a wrong mask is O(1)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


CASES = [  # (cp, T, H, K, sharding, causal)
    (2, 16, 4, 2, "zigzag", True),  # GQA, T a multiple of 2 cp
    (3, 13, 4, 1, "zigzag", True),  # one K/V head (MQA), padded to 18
    (4, 19, 4, 4, "zigzag", True),  # padded to 24: rank 0's second chunk is mostly padding
    (3, 12, 2, 2, "contiguous", True),
    (4, 10, 6, 3, "contiguous", True),  # padded to 12
    (2, 11, 4, 2, "zigzag", False),  # not causal: padded keys masked by key_valid
    (3, 9, 4, 2, "contiguous", False),
    (4, 3, 4, 2, "zigzag", False),  # ranks 1-3 hold only padding: whole key blocks masked (lse -inf)
]


@pytest.mark.parametrize(("cp", "T", "H", "K", "sharding", "causal"), CASES)
def test_ring_attention_equals_dense_attention_float64(cp, T, H, K, sharding, causal):
    results = run_on_ranks(sharded_body, cp, "ring", T, H, K, 3, sharding, causal)
    _check_against_dense(results, T, H, K, 3, sharding, causal)


@given(cp=st.sampled_from([2, 3, 4]), T=st.integers(1, 23), kv=st.sampled_from([(4, 4), (4, 2), (6, 1)]),
       sharding=st.sampled_from(["zigzag", "contiguous"]), causal=st.booleans(), seed=st.integers(0, 99))
def test_ring_attention_property_any_length_and_layout(cp, T, kv, sharding, causal, seed):
    H, K = kv
    results = run_on_ranks(sharded_body, cp, "ring", T, H, K, seed, sharding, causal)
    _check_against_dense(results, T, H, K, seed, sharding, causal)


@pytest.mark.parametrize(("cp", "sharding"), [(2, "zigzag"), (3, "contiguous"), (4, "zigzag")])
def test_ring_attention_ledger_bytes_match_formula(cp, sharding):
    """Per rank: forward cp-1 sends of one packed K/V block, 2 B Tl K D e bytes (K heads only,
    not H: GQA); backward cp-1 K/V blocks plus cp-1 dK/dV accumulators of the same size."""
    B, T, H, K, e = 2, 24, 4, 2, 8  # float64
    results = run_on_ranks(sharded_body, cp, "ring", T, H, K, 0, sharding, True)
    block = 2 * B * Layout(cp, sharding, T).local_len * K * D * e
    for _, fwd, bwd in results:
        assert [b for op, b in fwd if op == "isend"] == [block] * (cp - 1)
        assert [b for op, b in fwd if op == "irecv"] == [block] * (cp - 1)
        assert {op for op, _ in fwd} == {"isend", "irecv"}
        assert [b for op, b in bwd if op == "isend"] == [block] * (2 * (cp - 1))
        assert sum(b for op, b in bwd if op == "irecv") == 2 * (cp - 1) * block


def test_ring_attention_rejects_a_layout_for_another_group_size():
    results = run_on_ranks(_wrong_layout_body, 2)
    assert all("layout is for cp=3 but the group has 2 ranks" in r for r in results)


def _wrong_layout_body():
    from tinyscale.context_parallel.ring import ring_attention
    q = torch.zeros(1, 2, 4, 8)
    try:
        ring_attention(q, q, q, layout=Layout(3, "zigzag", 12))
    except ValueError as exc:
        return str(exc)
    return "no error"


def _timeline_body(cp_T):
    """Forward on this rank with each block's attention timed: per step, when its blocks ran, and
    when that step's K/V hop was posted and waited for."""
    import time

    import torch.distributed as dist

    from tinyscale.context_parallel import ring
    from tinyscale.context_parallel.sharding import block_plan, shard
    from tinyscale.dist import comm

    cp, rank = dist.get_world_size(), dist.get_rank()
    layout = Layout(cp, "zigzag", cp_T)
    q = shard(torch.randn(1, 2, cp_T, D, dtype=torch.float64), layout, rank, dim=2)
    calls, original = [], ring._attend

    def timed(*args, **kwargs):
        calls.append(time.perf_counter())
        out = original(*args, **kwargs)
        calls.append(time.perf_counter())
        return out

    ring._attend = timed
    try:
        with comm.record() as ledger:
            ring.ring_attention(q, q[:, :1], q[:, :1], layout=layout)
    finally:
        ring._attend = original
    per_step = [2 * len(block_plan(layout, rank, (rank - s) % cp, causal=True)) for s in range(cp)]
    bounds = [sum(per_step[:s]) for s in range(cp + 1)]
    steps = [(calls[bounds[s]], calls[bounds[s + 1] - 1]) for s in range(cp)]  # (first start, last end)
    sends = [(r.start, r.end) for r in ledger.rows if r.op == "isend"]
    recvs = [(r.start, r.end) for r in ledger.rows if r.op == "irecv"]
    return steps, sends, recvs


@pytest.mark.parametrize("cp", [2, 3])
def test_ring_attention_overlaps_the_next_hop_with_the_blocks_attention(cp):
    """Each step's K/V hop is posted before the step's blocks start and waited for only
    after they end: the transfer runs while this rank computes."""
    for steps, sends, recvs in run_on_ranks(_timeline_body, cp, 4 * cp):
        assert len(sends) == len(recvs) == cp - 1
        for s in range(cp - 1):
            compute_start, compute_end = steps[s]
            assert sends[s][0] < compute_start and recvs[s][0] < compute_start
            assert recvs[s][1] > compute_end


# float32: inputs exact, each of ~T-term sums rounds at 6e-8 relative; 1e-5 leaves 100x room
# and a wrong mask is O(1). bf16: block outputs are rounded to bf16 (8 bits) before the
# float32 merge, as flash-attention kernels return them: ~4e-3 relative per block, so 3e-2.
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_ring_attention_low_precision_close_to_float64(dtype, tol):
    cp, T, H, K = 3, 17, 4, 2
    results = run_on_ranks(sharded_body, cp, "ring", T, H, K, 1, "zigzag", True, dtype)
    for name, got, want in zip(NAMES, gathered(results, T, "zigzag"), dense(T, H, K, 1, True, rounded_to=dtype)):
        assert got.dtype == (torch.float32 if name == "lse" else dtype)
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("algorithm", ["ring", "ulysses"])
def test_ring_attention_and_ulysses_in_strided_subgroups(algorithm):
    """Two CP groups of 2 on 4 ranks, {0, 2} and {1, 3} (as a mesh with tp=2 makes them):
    group ranks differ from global ranks, and each group computes the attention alone."""
    T, H, K = 11, 4, 2
    results = run_on_ranks(sharded_body, 4, algorithm, T, H, K, 2, "zigzag", True, torch.float64, [[0, 2], [1, 3]])
    for members in ([0, 2], [1, 3]):
        for name, got, want in zip(NAMES, gathered([results[r] for r in members], T, "zigzag"), dense(T, H, K, 2, True)):
            if got is not None:  # float64, summation order only (see above)
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
