"""OPT-6's sweep (benchmarks/matmul_sweep.py): FLOPs counted as 2 m n k, FLOP/s as the best
of the timed repeats, and one row per dtype and size, aligned and odd (lesson 06).

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
