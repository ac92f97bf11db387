"""OPT-6's sweep (benchmarks/matmul_sweep.py): FLOPs counted as 2 m n k, FLOP/s as the best
of the timed repeats, and one row per dtype and size, aligned and odd (lesson 06). Speeds
are the machine's and the moment's, so they are reported, not asserted; what every row
asserts is that torch counts 2 n^3 FLOPs at aligned and odd sizes alike, and that each
dtype's result is within its rounding bound of float64 (bf16's price: a far larger error).

    pytest -k matmul_sweep
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("matmul_sweep", ROOT / "benchmarks/matmul_sweep.py")
matmul_sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(matmul_sweep)


def test_matmul_sweep_counts_two_flops_per_multiply_add():
    assert matmul_sweep.matmul_flops(3, 5, 7) == 2 * 3 * 5 * 7


def test_matmul_sweep_keeps_the_fastest_repeat():
    # a clock whose timed intervals are 4, 1, 2 s: the best repeat is the 1 s one
    ticks = iter([0, 4, 10, 11, 20, 22])
    flops = matmul_sweep.time_matmul(8, torch.float32, torch.device("cpu"), repeats=3, clock=lambda: next(ticks))
    assert flops == 2 * 8**3 / 1.0


def test_matmul_sweep_rows_cover_each_dtype_and_size(capsys):
    rows = matmul_sweep.main(["--device", "cpu", "--sizes", "64", "--repeats", "1"])
    assert [(r["dtype"], r["n"], r["aligned"]) for r in rows] == [
        (d, n, n == 64) for d in ("float64", "float32", "bfloat16") for n in (63, 64, 65)]
    assert all(r["flops"] > 0 for r in rows) and "TFLOP/s" in capsys.readouterr().out


def test_matmul_sweep_rows_count_two_n_cubed_flops_and_stay_within_each_dtypes_rounding_bound():
    rows = matmul_sweep.main(["--device", "cpu", "--sizes", "64", "--repeats", "1"])
    for r in rows:
        assert r["counted_flops"] == 2 * r["n"] ** 3, r  # odd sizes: slower, not more work
        assert r["err_over_bound"] <= 1.0, r  # a rounding bound (check_matmul), so no tolerance on top
    err = {(r["dtype"], r["n"]): r["max_abs_err"] for r in rows}
    for n in (63, 64, 65):
        # u is 2^16 times larger in bf16 than float32; bf16's output rounding alone is ~u|C| ~ 1e-2
        # at |C| ~ 8 (sqrt(64) terms of N(0,1) products), float32's ~1e-5: 100x is far inside.
        assert err[("bfloat16", n)] > 100 * err[("float32", n)]


def test_matmul_sweep_error_bound_catches_a_dropped_term(monkeypatch):
    # the bound has room for rounding only: a kernel that skipped one product of k fails it
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: mm(a[:, 1:], b[1:]))
    r = matmul_sweep.check_matmul(65, torch.float32, torch.device("cpu"))
    assert r["err_over_bound"] > 1.0 and r["counted_flops"] == 2 * 65 * 65 * 64


def test_matmul_sweep_error_bound_catches_bf16_accumulated_in_bf16(monkeypatch):
    # the 16-bit bound assumes a float32 accumulator; summing the products in bf16 breaks it
    def mm_bf16_sum(a, b):
        c = torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype)
        for j in range(a.shape[1]):
            c = c + a[:, j:j + 1] * b[j:j + 1]
        return c
    monkeypatch.setattr(torch, "mm", mm_bf16_sum)
    assert matmul_sweep.check_matmul(65, torch.bfloat16, torch.device("cpu"))["err_over_bound"] > 1.0
