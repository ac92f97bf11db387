"""Sequence layouts for context parallelism (no processes): positions, shard/unshard,
padding, the per-block causal plan, and the load balance of causal attention.

Run: `pytest -k zigzag` (with the contiguous layout beside it: `pytest -k cp_contiguous`).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tinyscale.context_parallel.sharding import (
    IGNORE_INDEX,
    Layout,
    attention_work,
    block_plan,
    plan_work,
    shard,
    unshard,
)

layouts = st.builds(Layout, cp=st.sampled_from([2, 3, 4]), sharding=st.sampled_from(["zigzag", "contiguous"]),
                    seq_len=st.integers(1, 40))


def test_zigzag_rank_i_holds_chunks_i_and_2n_minus_1_minus_i():
    layout = Layout(3, "zigzag", 12)  # 6 chunks of 2
    assert [layout.chunks(r) for r in range(3)] == [(0, 5), (1, 4), (2, 3)]
    assert layout.positions(0).tolist() == [0, 1, 10, 11]
    assert layout.positions(2).tolist() == [4, 5, 6, 7]
    assert Layout(3, "contiguous", 12).positions(1).tolist() == [4, 5, 6, 7]


def test_zigzag_pads_to_a_multiple_of_2cp_and_masks_the_padding():
    layout = Layout(2, "zigzag", 7)  # 4 chunks of 2: one padded position, 7
    assert (layout.padded_len, layout.chunk_len, layout.local_len) == (8, 2, 4)
    assert layout.positions(0).tolist() == [0, 1, 6, 7]
    assert layout.valid(0).tolist() == [True, True, True, False]
    targets = torch.arange(7)[None, :]  # (1, T)
    assert shard(targets, layout, 0, pad_value=IGNORE_INDEX).tolist() == [[0, 1, 6, IGNORE_INDEX]]


@given(layouts)
def test_zigzag_shard_then_unshard_is_the_identity(layout):
    x = torch.randn(2, layout.seq_len, 3)  # (B, T, C)
    pieces = [shard(x, layout, r) for r in range(layout.cp)]
    assert all(p.shape == (2, layout.local_len, 3) for p in pieces)
    assert torch.equal(unshard(pieces, layout), x)
    every = torch.cat([layout.positions(r) for r in range(layout.cp)])
    assert sorted(every.tolist()) == list(range(layout.padded_len))  # each position on exactly one rank


@given(layouts, st.booleans())
def test_zigzag_block_plan_covers_exactly_the_causal_mask(layout, causal):
    """Painting every planned block reproduces mask[i, j] = pos_k[j] <= pos_q[i] between every
    pair of ranks, each pair painted once: skipped blocks are wholly masked, diagonal blocks
    are causal, the rest full."""
    for q_rank in range(layout.cp):
        for kv_rank in range(layout.cp):
            pos_q, pos_k = layout.positions(q_rank), layout.positions(kv_rank)
            expected = pos_k[None, :] <= pos_q[:, None]  # (Tl, Tl): key j visible to query i
            if not causal:
                expected = torch.ones_like(expected)
            painted = torch.zeros(len(pos_q), len(pos_k), dtype=torch.int64)
            for rows, cols, kind in block_plan(layout, q_rank, kv_rank, causal=causal):
                n, m = rows.stop - rows.start, cols.stop - cols.start
                block = torch.ones(n, m, dtype=torch.int64)
                painted[rows, cols] += block.tril() if kind == "causal" else block
            assert torch.equal(painted, expected.long()), (layout, q_rank, kv_rank)


def test_zigzag_plan_skips_future_blocks():
    layout = Layout(4, "contiguous", 16)
    assert block_plan(layout, 0, 3, causal=True) == []  # rank 0's queries precede all of rank 3's keys
    assert block_plan(layout, 2, 2, causal=True) == [(slice(0, 4), slice(0, 4), "causal")]


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_zigzag_attention_work_is_equal_on_every_rank(cp):
    """Rank i's chunks i and 2cp-1-i: L^2 (2cp-1) + L (L+1) pairs, whatever i."""
    L = 5
    layout = Layout(cp, "zigzag", 2 * cp * L)
    work = attention_work(layout)
    assert work == [L * L * (2 * cp - 1) + L * (L + 1)] * cp
    assert sum(work) == layout.seq_len * (layout.seq_len + 1) // 2  # the whole causal triangle, once
    assert [plan_work(layout, r) for r in range(cp)] == work  # what the ring computes is just that


@given(layouts)
def test_zigzag_work_differs_by_less_than_one_chunk_with_padding(layout):
    """Without padding every rank does the same work; padding takes away only the rows it
    covers, so the spread is at most those rows' work, and under the work of one chunk of
    query rows against the padded sequence (L x P)."""
    if layout.sharding != "zigzag":
        return
    work = attention_work(layout)
    padding_rows_work = sum(p + 1 for p in range(layout.seq_len, layout.padded_len))
    assert max(work) - min(work) <= min(padding_rows_work, layout.chunk_len * layout.padded_len)
    assert sum(work) == layout.seq_len * (layout.seq_len + 1) // 2


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_work_within_5_percent_at_long_odd_lengths(cp):
    work = attention_work(Layout(cp, "zigzag", 4001))  # padded by 7 (cp 4) or 3 (cp 2)
    assert max(work) / min(work) < 1.05


@pytest.mark.parametrize(("cp", "L"), [(2, 4), (3, 5), (4, 8)])
def test_cp_contiguous_work_imbalance_matches_formula(cp, L):
    """Rank i sees rows iL .. (i+1)L - 1, each p + 1 keys: L^2 i + L(L+1)/2 pairs, so
    max/min = ((2cp - 1) L + 1) / (L + 1), which tends to 2cp - 1 for long chunks."""
    layout = Layout(cp, "contiguous", cp * L)
    work = attention_work(layout)
    assert work == [L * L * i + L * (L + 1) // 2 for i in range(cp)]
    assert Fraction(max(work), min(work)) == Fraction((2 * cp - 1) * L + 1, L + 1)
    assert [plan_work(layout, r) for r in range(cp)] == work


def test_zigzag_layout_rejects_bad_input_with_the_field():
    with pytest.raises(ValueError, match="sharding='stripes'"):
        Layout(2, "stripes", 8)
    with pytest.raises(ValueError, match="Layout.seq_len=0"):
        Layout(2, "zigzag", 0)
    with pytest.raises(ValueError, match="length 5 along dim 1 but the layout's seq_len is 8"):
        shard(torch.zeros(1, 5), Layout(2, "zigzag", 8), 0)
