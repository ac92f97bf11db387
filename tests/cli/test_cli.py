"""`tinyscale train`: spawned ranks, torchrun, outputs on disk, and clear errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tinyscale.cli import main


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def test_cli_train_every_preset_is_valid_at_its_own_world_size_and_at_2():
    """`make_spec` checks a preset's config, model split and batch before any process starts."""
    from tinyscale.train import PRESETS, make_spec

    for preset, p in PRESETS.items():
        for world in {p["world_size"], 2}:
            spec = make_spec(preset, world_size=world, steps=3, model="tiny")
            assert spec.world_size == world and spec.config == p["config"]


# Each run spawns its ranks and measures this CPU's matmul peak (3 to 8 s): the CLI path is the same
# for every preset, and the engine's tests cover each layout, so zero2 and zero3 (zero3-offload takes
# the ZeRO 3 path) run under --thorough.
@pytest.mark.parametrize("preset", ["ddp", pytest.param("zero2", marks=pytest.mark.thorough),
                                    pytest.param("zero3", marks=pytest.mark.thorough), "zero3-offload", "tp"])
def test_cli_train_matches_the_reference_and_writes_its_outputs(preset, tmp_path, capsys):
    code = main(["train", "--preset", preset, "--world-size", "2", "--steps", "3", "--model", "tiny",
                 "--run-dir", str(tmp_path), "--timeout", "120"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = _summary(tmp_path)
    assert summary["matches_reference"] is True and summary["max_param_diff"] <= 1e-10
    assert summary["world_size"] == 2 and summary["dtype"] == "float64"
    assert summary["comm"]["all_reduce"]["calls"] > 0
    if preset != "ddp":  # ZeRO's, or (tp) sequence parallelism's between the layers
        assert summary["comm"]["reduce_scatter"]["calls"] > 0 and summary["comm"]["all_gather"]["calls"] > 0
    if preset.startswith("zero"):
        assert summary["memory_per_rank"]["master_weights"] > 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all({"loss", "reference_loss", "tokens_per_s", "step_time_s"} <= r.keys() for r in rows)
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert "matches" in out and "comm all_reduce" in out
    # MFU against this CPU's measured matmul peak: a real fraction, the formula's (tests/engine/test_engine_mfu.py)
    # HFU adds what the SDPA core's backward recomputes (Q K^T), and tp's padded vocabulary rows: none here
    from tinyscale.mfu import forward_flops
    from tinyscale.models import GPTConfig

    f = forward_flops(GPTConfig.preset("tiny"), GPTConfig.preset("tiny").max_seq_len)
    assert summary["hfu"] == pytest.approx(summary["mfu"] * f.hardware() / f.model, rel=1e-12)  # rounding only
    assert 0 < summary["mfu"] < summary["hfu"] < 1 and summary["peak_flops"] > 0 and "MFU / HFU" in out
    assert all(r["mfu_window"] is not None and 0 < r["mfu_window"] < 1 for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "0"], "--world-size must be at least 1"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--world-size", "3", "--config", "CFG"], "train_batch_size must equal"),
])
def test_cli_train_bad_input_exits_2_with_the_fix(argv, message, tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                               "gradient_accumulation_steps": 1}))
    argv = [str(cfg) if a == "CFG" else a for a in argv]
    assert main(["train", "--model", "tiny", *argv]) == 2
    assert message in capsys.readouterr().out


def test_cli_train_runs_under_torchrun(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")  # ships with torch
    proc = subprocess.run(
        [torchrun, "--nproc-per-node", "2", "-m", "tinyscale.train", "--preset", "ddp", "--steps", "2",
         "--model", "tiny", "--run-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = _summary(tmp_path)
    assert summary["world_size"] == 2 and summary["matches_reference"] is True
