"""`tinyscale autotune`: short trials of the planner's candidates, the fastest config written (key: autotune).

Small and fast: the tiny GPT on 2 pooled ranks (the tests' runner instead of a launch per trial),
one timed step per trial. A trial over the memory limit, or over the time limit, is stopped and
marked, and the next trial still runs. The planner plans for the machine measured on the ranks
at start (planner/measure.py), or for the values given: the tests check that the values reach
the plan and the output, never how fast this machine is.
Run: `pytest tests/planner -k autotune`.
"""

from __future__ import annotations

import json

import pytest

from tinyscale.cli import main
from tinyscale.config import EngineConfig
from tinyscale.models.config import PRESETS
from tinyscale.planner import Layout
from tinyscale.planner import estimate
from tinyscale.planner.autotune import autotune, layout_of_config, machine, run_trial, trial_config
from tinyscale.planner.measure import MEASURED_KEYS, cpu_cluster, measure_machine
from tinyscale.testing import run_on_ranks

BASE = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 1}}


# a made-up machine for the tests that are not about measuring it (no launch spent on it): the
# guesses autotune planned with before it measured, whose candidates are cheap to run
FIXED = {"peak": 50e9, "alpha": 5e-6, "beta": 300e9, "launch": 1e-3}


def _runner(fn, world, *args):
    return run_on_ranks(fn, world, *args, timeout_s=300)


def test_autotune_trial_configs_keep_the_user_s_keys_and_validate():
    own = layout_of_config(BASE, 2)
    assert own == Layout(dp=2, zero_stage=1, micro_batch=1)
    cfg = trial_config(BASE, Layout(tp=2, micro_batch=2, zero_stage=3, policy="full"))
    assert cfg["optimizer"] == BASE["optimizer"] and cfg["zero_optimization"]["stage"] == 3
    assert cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] == 4
    EngineConfig.load(cfg)  # a config the engine takes


def test_autotune_runs_trials_and_picks_the_fastest():
    done, best = autotune(PRESETS["tiny"], BASE, 2, seq_len=16, trials=3, steps=1, runner=_runner,
                          cluster=cpu_cluster(2, FIXED))
    assert len(done) == 3 and done[0].layout == layout_of_config(BASE, 2)  # the user's own first
    assert all(t.status == "ok" and t.tokens_per_s > 0 for t in done)
    assert best is max(done, key=lambda t: t.tokens_per_s)
    assert len({t.layout for t in done}) == 3


def test_autotune_stops_a_trial_out_of_memory_or_time_and_goes_on():
    # a limit below the states of any layout: every trial stops after its warm-up, none is best
    done, best = autotune(PRESETS["tiny"], BASE, 2, seq_len=16, trials=2, steps=1, memory_limit=1000, runner=_runner,
                          cluster=cpu_cluster(2, FIXED))
    assert [t.status for t in done] == ["out of memory"] * 2 and best is None
    done, best = autotune(PRESETS["tiny"], BASE, 2, seq_len=16, trials=2, steps=2, time_limit_s=0.0, runner=_runner,
                          cluster=cpu_cluster(2, FIXED))
    assert [t.status for t in done] == ["out of time"] * 2 and best is None


def test_autotune_a_failing_trial_does_not_stop_the_next(monkeypatch):
    calls = []

    def flaky(fn, world, *args):
        calls.append(args[1])
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return _runner(fn, world, *args)

    done, best = autotune(PRESETS["tiny"], BASE, 2, seq_len=16, trials=2, steps=1, runner=flaky,
                          cluster=cpu_cluster(2, FIXED))
    assert [t.status for t in done] == ["out of memory", "ok"] and best is done[1]


def test_autotune_cli_writes_the_best_config(tmp_path, monkeypatch, capsys):
    import tinyscale.dist

    monkeypatch.setattr(tinyscale.dist, "launch", lambda fn, n, *a, timeout_s=None: _runner(fn, n, *a))
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(BASE))
    out = tmp_path / "best.json"
    assert main(["autotune", "--config", str(cfg), "--world-size", "2", "--model", "tiny", "--seq-len", "16",
                 "--trials", "2", "--steps", "1", "--out", str(out)]) == 0
    best = json.loads(out.read_text())
    assert best["train_batch_size"] == 4 and best["optimizer"]["params"]["lr"] == pytest.approx(3e-3)
    printed = " ".join(capsys.readouterr().out.split())
    assert "wrote" in printed and "GFLOP/s (measured)" in printed and "per layer (measured)" in printed


def test_autotune_measures_the_machine_on_the_ranks_and_takes_given_values():
    m = machine(PRESETS["tiny"], 2, runner=_runner)
    assert set(m) == set(MEASURED_KEYS) and all(0 < v < float("inf") for v in m.values())
    cpu_cluster(2, m)  # a cluster the planner takes
    m = machine(PRESETS["tiny"], 2, given={"peak": 7e9, "beta": None}, runner=_runner)
    assert m["peak"] == 7e9 and m["beta"] > 0  # None: measured

    def no_launch(*a):
        raise AssertionError("all four given: nothing to measure")
    assert machine(PRESETS["tiny"], 2, given=FIXED, runner=no_launch) == FIXED
    with pytest.raises(ValueError, match="peak=0"):
        cpu_cluster(2, FIXED | {"peak": 0})


@pytest.mark.parametrize("peak", [1e9, 1e12])
def test_autotune_plans_with_the_machine_it_measured(peak):
    """The candidates' planned times are the planner's on the measured machine (a stub measures
    `peak`; trials are stubbed too): a guess in place of the measurement fails one of the two."""
    seen = {"peak": peak, "alpha": 2e-5, "beta": 3e9, "launch": 2e-4}

    def stub(fn, world, *args):
        if fn is measure_machine:
            return [seen] * world
        assert fn is run_trial
        return [{"status": "ok", "steps": 1, "seconds": 0.01, "memory": 1.0}] * world

    done, _ = autotune(PRESETS["tiny"], BASE, 2, seq_len=16, trials=2, steps=1, runner=stub)
    cfg = PRESETS["tiny"].with_(max_seq_len=max(16, PRESETS["tiny"].max_seq_len))
    for t in done:
        want = estimate(cfg, t.layout, cpu_cluster(2, seen), global_batch=4, seq_len=16, dtype_bytes=4,
                        compute_bytes=None).time["total"]
        assert t.predicted_s == pytest.approx(want, rel=1e-12)


def test_autotune_cli_prints_what_it_measured_or_was_given(tmp_path, monkeypatch, capsys):
    import tinyscale.dist

    def launch(fn, n, *a, timeout_s=None):
        assert fn is not measure_machine, "all four values given: nothing to measure"
        return _runner(fn, n, *a)
    monkeypatch.setattr(tinyscale.dist, "launch", launch)
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(BASE))
    assert main(["autotune", "--config", str(cfg), "--world-size", "2", "--model", "tiny", "--seq-len", "16",
                 "--trials", "1", "--steps", "1", "--out", str(tmp_path / "best.json"), "--peak-gflops", "12.5",
                 "--link-latency-us", "40", "--link-gbps", "2", "--host-overhead-ms", "0.25"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("matmul peak 12.5 GFLOP/s (given), all-reduce alpha 40 us (given), beta 2.00 GB/s (given), "
            "host 0.250 ms per layer (given)") in out
