"""Ulysses (all-to-all to head shards, local attention, all-to-all back) equals attention
over the whole sequence (SDPA, float64), forward and backward, for cp 2-4, both layouts,
GQA with K/V heads split or replicated, padded lengths; heads % cp != 0 is refused; the
ledger shows 4 all-to-alls per forward of the stated sizes. Run: `pytest -k ulysses`."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.context_parallel.cases import D, dense, gathered, sharded_body
from tinyscale.context_parallel.sharding import Layout
from tinyscale.context_parallel.ulysses import kv_replication
from tinyscale.testing import run_on_ranks


def _check(cp, T, H, K, seed, sharding, causal):
    results = run_on_ranks(sharded_body, cp, "ulysses", T, H, K, seed, sharding, causal)
    for name, got, want in zip(["out", "lse", "dq", "dk", "dv"], gathered(results, T, sharding),
                               dense(T, H, K, seed, causal)):
        if got is not None:  # Ulysses returns no lse
            # float64, only the summation order differs from SDPA (~1e-15); a bug is O(1)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    return results


CASES = [  # (cp, T, H, K, sharding, causal)
    (2, 16, 4, 2, "zigzag", True),  # K/V heads split: K % cp == 0
    (3, 13, 6, 2, "zigzag", True),  # K=2 on cp=3: each K/V head replicated lcm(2,3)/2 = 3 times
    (4, 10, 4, 1, "contiguous", True),  # MQA on 4 ranks, padded to 12
    (2, 9, 2, 2, "contiguous", False),  # not causal, padded keys masked
]


@pytest.mark.parametrize(("cp", "T", "H", "K", "sharding", "causal"), CASES)
def test_ulysses_equals_dense_attention_float64(cp, T, H, K, sharding, causal):
    _check(cp, T, H, K, 5, sharding, causal)


@given(cp=st.sampled_from([2, 3, 4]), T=st.integers(1, 21), sharding=st.sampled_from(["zigzag", "contiguous"]),
       causal=st.booleans(), seed=st.integers(0, 99), K=st.sampled_from([1, 2, 3, 6, 12]))
def test_ulysses_property_any_length_and_kv_heads(cp, T, sharding, causal, seed, K):
    _check(cp, T, 12, K, seed, sharding, causal)


@pytest.mark.parametrize(("cp", "H", "K"), [(2, 4, 2), (4, 4, 2), (3, 6, 2)])
def test_ulysses_ledger_four_all_to_alls_per_forward(cp, H, K):
    """Forward: q and out move B H Tl D e bytes each (this rank's input), k and v
    B K' Tl D e with K' = lcm(K, cp) (K/V heads replicated only when cp does not divide K).
    The backward moves the same four tensors' gradients the other way."""
    B, T, e = 2, 24, 8
    results = run_on_ranks(sharded_body, cp, "ulysses", T, H, K, 0, "zigzag", True)
    Tl = Layout(cp, "zigzag", T).local_len
    kv_heads = K * kv_replication(H, K, cp)
    expected = [B * H * Tl * D * e, B * kv_heads * Tl * D * e, B * kv_heads * Tl * D * e, B * H * Tl * D * e]
    for _, fwd, bwd in results:
        assert fwd == [("all_to_all", b) for b in expected]
        assert sorted(b for _, b in bwd) == sorted(expected) and {op for op, _ in bwd} == {"all_to_all"}


def test_ulysses_kv_replication_rule():
    assert kv_replication(8, 4, 2) == 1  # split
    assert kv_replication(8, 2, 4) == 2  # K < cp: 4 K/V heads, one per rank
    assert kv_replication(6, 2, 3) == 3
    with pytest.raises(ValueError, match=r"n_head=6 % cp=4 = 2"):
        kv_replication(6, 3, 4)


def test_ulysses_permute_gradient_is_the_inverse_gather():
    """Ulysses' reorder (shard order <-> position order) differentiates as index_select does,
    by a gather with the inverse permutation instead of a zero fill and an index_add."""
    from tinyscale.context_parallel.ulysses import Permute

    g = torch.Generator().manual_seed(0)
    index = torch.randperm(7, generator=g)  # not its own inverse (checked below)
    inverse = torch.argsort(index)
    assert not torch.equal(index, inverse)
    x = torch.randn(2, 3, 7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(2, 3, 7, 4, dtype=torch.float64, generator=g)
    (grad_ours,) = torch.autograd.grad((Permute.apply(x, index, inverse, 2) * weight).sum(), x)
    (grad_torch,) = torch.autograd.grad((x.index_select(2, index) * weight).sum(), x)
    assert torch.equal(Permute.apply(x, index, inverse, 2), x.index_select(2, index))
    assert torch.equal(grad_ours, grad_torch)
