"""QSGD (scale ||x||_2, the paper's) and its max-norm variant (scale max |x|): each one's
variance against its bound, and the scale agreed across ranks (`pytest -k compression_qsgd_norm`).

The variance of stochastic rounding is known exactly: sum_i (scale / s)^2 f_i (1 - f_i), with
f_i the fractional part of |x_i| / scale * s. The bounds: n scale^2 / (4 s^2) for either, and
the paper's min(n / s^2, sqrt(n) / s) ||x||^2 for the L2 scale (Alistarh et al. 2017, Lemma 3.1).
`VARIANCE_TABLE` is lesson 10's table, computed here; the test fails if the lesson's differs.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tinyscale.compression import QSGD
from tinyscale.compression.base import compressed_mean
from tinyscale.testing import run_on_ranks

LESSON = Path(__file__).resolve().parents[2] / "lessons" / "10-compression.md"
N, DRAWS = 256, 2000


def exact_variance(x: torch.Tensor, comp: QSGD) -> float:
    scale = comp._scale(x).item()
    y = x.abs() / scale * comp.levels
    f = y - y.floor()
    return ((scale / comp.levels) ** 2 * f * (1 - f)).sum().item()


def bounds(x: torch.Tensor, comp: QSGD) -> tuple[float, float | None]:
    """n scale^2 / (4 s^2) (every element's bound, summed); for the L2 scale also the paper's."""
    s, n, scale = comp.levels, x.numel(), comp._scale(x).item()
    paper = min(n / s ** 2, math.sqrt(n) / s) * x.norm().item() ** 2 if comp.norm == "l2" else None
    return n * scale ** 2 / (4 * s ** 2), paper


@functools.cache
def variance_rows() -> list[tuple]:
    """(norm, bits, measured, exact, bound, the paper's bound or None), each relative to ||x||^2,
    for x ~ N(0, 1)^256 and 2000 draws."""
    x = torch.randn(N, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sq = x.norm().item() ** 2
    rows = []
    for norm in ("l2", "max"):
        for bits in (8, 4):
            comp = QSGD(bits, seed=3, norm=norm)
            errors = torch.stack([comp.decompress(comp.compress(x)) - x for _ in range(DRAWS)])  # (D, n)
            measured = errors.pow(2).sum(1).mean().item()
            loose, paper = bounds(x, comp)
            rows.append((norm, bits, measured / sq, exact_variance(x, comp) / sq, loose / sq,
                         None if paper is None else paper / sq))
    return rows


def lesson_row(norm, bits, measured, exact, loose, paper) -> str:
    name = {"l2": "QSGD (L2 scale, the paper's)", "max": "max-norm variant"}[norm]
    return f"| {name} | {bits} | {measured:.3g} | {exact:.3g} | {loose:.3g} | {'-' if paper is None else f'{paper:.3g}'} |"


def test_compression_qsgd_norm_variance_matches_the_exact_formula_within_each_bound():
    for norm, bits, measured, exact, loose, paper in variance_rows():
        # a mean of 2000 draws of a sum of 256 independent terms: relative spread ~ sqrt(2 / 2000) ~ 3%
        assert abs(measured - exact) <= 0.1 * exact, (norm, bits, measured, exact)
        assert exact <= loose and (paper is None or exact <= paper), (norm, bits, exact, loose, paper)
    (_, _, _, l2_8, *_), _, (_, _, _, max_8, *_), _ = variance_rows()
    assert max_8 < l2_8 / 10  # the max-norm grid is finer: max |x| << ||x||_2 for a long vector


def test_compression_qsgd_norm_lesson_table_is_the_measured_one():
    text = LESSON.read_text()
    for row in variance_rows():
        line = lesson_row(*row)
        assert line in text, f"lessons/10-compression.md lacks the row\n{line}"


def _scale_body(norm: str):
    # ranks of very different sizes: the max over ranks and the sum differ by far
    x = torch.randn(40, generator=torch.Generator().manual_seed(dist.get_rank()), dtype=torch.float64)
    x *= 10.0 ** dist.get_rank()
    comp = QSGD(4, seed=1, norm=norm)
    comp.agree(x)
    payload = comp.compress(x)
    exact = x.clone()
    dist.all_reduce(exact)
    return x, payload.meta["scale"], compressed_mean(x, comp, payload=payload), exact / dist.get_world_size()


@pytest.mark.parametrize("norm", ["max", "l2"])
def test_compression_qsgd_norm_scale_is_the_largest_over_the_ranks(norm):
    """Every rank quantises against the largest scale of the group: the max over ranks, not
    their sum (a sum stays unbiased but makes every level N times coarser)."""
    results = run_on_ranks(_scale_body, 3, norm)
    local = [(x.norm() if norm == "l2" else x.abs().max()).item() for x, *_ in results]
    for x, scale, mean, exact in results:
        assert scale.item() == max(local)
        # each rank's rounding error is below one level, scale / s; so is the mean's
        assert (mean - exact).abs().max().item() <= scale.item() / 7 * (1 + 1e-12)
