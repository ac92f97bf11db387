"""`profile` reports nccl-tests' figures, the same on every rank."""

from __future__ import annotations

import pytest

from tinyscale.collectives import ALL_REDUCE, profile
from tinyscale.testing import run_on_ranks


def _profile(sizes):
    return profile({"ring": ALL_REDUCE["ring"], "torch": "tinyscale.dist.comm:all_reduce"}, sizes, repeats=2)


def test_collectives_profile_reports_algbw_and_busbw():
    n, sizes = 2, [1024, 4096 + 2]  # 4098 bytes: 1024 float32 elements (whole elements only)
    results = run_on_ranks(_profile, n, sizes)
    assert results[0] == results[1]  # times are the max over ranks: one answer for all
    rows = results[0]
    assert [(r["algorithm"], r["bytes"]) for r in rows] == [("ring", 1024), ("torch", 1024),
                                                           ("ring", 4096), ("torch", 4096)]
    for r in rows:
        assert 0 < r["min_seconds"] <= r["seconds"]
        assert r["algbw"] == pytest.approx(r["bytes"] / r["seconds"])
        assert r["busbw"] == pytest.approx(r["algbw"] * 2 * (n - 1) / n)  # all-reduce's bus factor
