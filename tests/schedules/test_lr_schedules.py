"""The schedules the OPT-16 figure plots (benchmarks/lr_schedules.py), from the engine's
`lr_at`: warm-up rises to the peak, decays end where their configs say, and the batch-size
comparison spends the same token budget (lesson 02, "Learning-rate schedules").

    pytest -k lr_schedule
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("lr_schedules", ROOT / "benchmarks/lr_schedules.py")
lr_schedules = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lr_schedules)

PEAK, W, T = lr_schedules.PEAK, lr_schedules.WARMUP, lr_schedules.TOTAL
REL = 1e-12  # pure float arithmetic on a handful of values: agreement to rounding


@pytest.mark.parametrize("label", list(lr_schedules.CURVES))
def test_lr_schedule_warms_up_to_the_peak_and_never_exceeds_it(label):
    values = lr_schedules.series(lr_schedules.CURVES[label](), T)
    assert values[0] == 0.0  # warmup_min_lr
    top = values.index(max(values))
    assert top in (W, W + 1)  # DeepSpeed's step k runs at the formula's k - 1: the top comes a step late
    assert all(a <= b for a, b in zip(values[:top], values[1:top + 1]))  # non-decreasing warm-up
    # the peak itself, except the cosine after a linear warm-up: DeepSpeed's warm-up stops at
    # (W - 1) / W of it and its decay starts one step in, so that curve tops out just below it
    assert PEAK * (1 - 1 / W) <= max(values) <= PEAK * (1 + REL)
    assert "Cosine" in label or math.isclose(max(values), PEAK, rel_tol=REL)
    assert all(a >= b for a, b in zip(values[top:], values[top + 1:]))  # never rises after warm-up


def test_lr_schedule_decays_end_where_configured():
    decay = lr_schedules.series(lr_schedules.config("WarmupDecayLR"), T + 5)
    cosine = lr_schedules.series(lr_schedules.config("WarmupCosineLR"), T + 5)
    assert decay[T + 1] == 0.0 and decay[-1] == 0.0 < decay[T]  # linear decay reaches 0 at i = T (step T + 1)
    assert math.isclose(cosine[T], 0.1 * PEAK, rel_tol=REL) and math.isclose(cosine[-1], 0.1 * PEAK, rel_tol=REL)
    # halfway through the decay the cosine is at the mean of peak and floor, the line at half the peak
    mid = W + (T - W) // 2
    assert math.isclose(cosine[mid], PEAK * (0.1 + 0.9 * 0.5), rel_tol=REL)
    assert math.isclose(decay[mid + 1], PEAK * 0.5, rel_tol=REL)


def test_lr_schedule_figure_is_written(tmp_path, capsys):
    lr_schedules.main(["--out", str(tmp_path / "f.svg")])
    assert (tmp_path / "f.svg").stat().st_size > 1000 and "WarmupCosineLR" in capsys.readouterr().out
