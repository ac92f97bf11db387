"""The benchmarks' shared timing harness (tinyscale.bench): round-robin order, warm-up dropped,
the slowest rank per step, median and spread, and the JSON that `make bench` merges.
Run: `pytest -k bench_harness`."""

from __future__ import annotations

import json

import pytest

from tinyscale.bench import merge, ratio_interval, round_robin, slowest, summary, write_json


def test_bench_harness_round_robin_interleaves_and_drops_warmup():
    calls = []
    times = round_robin({"a": lambda i: calls.append(("a", i)), "b": lambda i: calls.append(("b", i))}, 3,
                        warmup=2, before=lambda: calls.append("barrier"))
    assert calls == [x for i in range(5) for x in ("barrier", ("a", i), "barrier", ("b", i))]
    assert [len(t) for t in times.values()] == [3, 3]


def test_bench_harness_round_robin_alternates_the_compared_pair_every_other_round():
    calls = []
    times = round_robin({name: lambda i, name=name: calls.append((name, i)) for name in "xabc"}, 3, warmup=1,
                        alternate=("a", "c"))
    # a and c trade places in odd rounds: each follows x and b as often; the others keep theirs
    assert calls == [(name, i) for i in range(4) for name in ("xabc" if i % 2 == 0 else "xcba")]
    assert {name: len(t) for name, t in times.items()} == dict.fromkeys("xabc", 3)


def test_bench_harness_round_robin_shuffled_rounds_repeat_on_every_rank_and_vary_the_predecessor():
    def run(seed):
        calls = []
        round_robin({name: lambda i, name=name: calls.append(name) for name in "abcd"}, 40, warmup=0,
                    shuffle=seed)
        return [calls[4 * i:4 * i + 4] for i in range(40)]
    rounds = run(7)
    assert rounds == run(7)  # the same seed gives every rank the same order, round by round
    assert all(sorted(r) == list("abcd") for r in rounds)  # each variant once a round
    before_a = {r[r.index("a") - 1] for r in rounds if r[0] != "a"}
    assert before_a == set("bcd")  # "a" follows each of the others in some round
    assert rounds != run(8)
    with pytest.raises(ValueError, match="not both"):
        round_robin({"a": lambda i: None, "b": lambda i: None}, 1, alternate=("a", "b"), shuffle=0)


def test_bench_harness_slowest_rank_and_summary():
    assert slowest([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == [3.0, 5.0, 2.5]
    s = summary([3.0, 5.0, 2.5])
    assert (s.median, s.low, s.high, s.n) == (3.0, 2.5, 5.0, 3)


def test_bench_harness_ratio_interval_says_when_a_run_cannot_tell_two_variants_apart():
    # 30 rounds whose load swings from 1x to 3x, hitting both variants of a round alike
    load = [1 + 2 * ((7 * i) % 30) / 29 for i in range(30)]
    base = [0.1 * x for x in load]
    jitter = [1 + 0.04 * ((-1) ** i) * ((i % 5) / 4) for i in range(30)]  # +-4% per step, no bias
    low, high = ratio_interval([b * j for b, j in zip(base, jitter)], base)
    assert low < 1 < high and high - low < 0.2  # the same speed: 1.0 inside, and not a vacuous interval
    low, high = ratio_interval([1.1 * b * j for b, j in zip(base, jitter)], base)
    assert 1 < low < 1.1 < high  # 10% slower: the interval holds 1.1 and leaves 1.0 out
    assert ratio_interval(base, base) == (1.0, 1.0)
    # bursts of load as this machine has them (steps of 65 or 90 ms, about half the rounds each):
    # per round, the load divides out and the interval is as narrow as the jitter; the ratio of
    # medians, resampled, can take its two medians from different modes: at least twice as wide
    burst = [0.065 if (7 * i) % 30 < 15 else 0.09 for i in range(30)]
    ours = [1.05 * b * j for b, j in zip(burst, jitter)]
    low, high = ratio_interval(ours, burst, per_round=True)
    assert 1.05 * 0.96 <= low < 1.05 < high <= 1.05 * 1.04
    wide_low, wide_high = ratio_interval(ours, burst)
    assert wide_high - wide_low > 2 * (high - low)


def test_bench_harness_json_files_merge_into_one(tmp_path):
    write_json(str(tmp_path / "a.json"), {"cp_ring_vs_sdpa": 0.5}, seq_len=2048)
    write_json(str(tmp_path / "b.json"), {"ddp_bucketed_vs_torch_2": 0.97})
    write_json(None, {"ignored": 1.0})  # no --json: nothing written
    merged = merge(str(tmp_path / "bench.json"), [str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert merged["ratios"] == {"cp_ring_vs_sdpa": 0.5, "ddp_bucketed_vs_torch_2": 0.97}
    assert json.loads((tmp_path / "bench.json").read_text()) == merged
    assert merged["runs"]["a"]["seq_len"] == 2048 and len(merged["runs"]["a"]["machine"]["load_average"]) == 3


def _load_benchmark(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_harness_deepspeed_missing_exits_0_and_writes_no_ratios(tmp_path, monkeypatch, capsys):
    """`make bench` without the [peers] extra: benchmarks/deepspeed.py measures nothing, says
    how to install it, exits 0, and its --json holds no ratios (no stale ones to merge)."""
    bench = _load_benchmark("deepspeed")
    monkeypatch.setattr(bench.deepspeed_peer, "available", lambda: False)
    out = tmp_path / "deepspeed.json"
    assert bench.main(["--json", str(out)]) == 0
    assert "pip install" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["ratios"] == {} and "DeepSpeed" in record["skipped"]


def test_bench_harness_watch_run_without_tensorboard_exits_0(tmp_path, monkeypatch, capsys):
    import importlib.util
    import sys

    bench = _load_benchmark("watch_run")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    monkeypatch.setattr(bench, "launch", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran anyway")))
    out = tmp_path / "watch_run.json"
    monkeypatch.setattr(sys, "argv", ["watch_run.py", "--json", str(out), "--out", str(tmp_path / "w.svg")])
    bench.main()  # returns; no SystemExit
    assert "needs tensorboard" in capsys.readouterr().out
    assert json.loads(out.read_text())["ratios"] == {} and not (tmp_path / "w.svg").exists()


FAKE_BENCHMARK = '''
import json, sys
from pathlib import Path
counter = Path(__file__).with_suffix(".count")
n = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(n))
with open(Path(__file__).parent / "order.txt", "a") as f:
    f.write(Path(__file__).stem + str(n) + " ")
ratios = {"%s": [0.9, 0.5, 0.6][n - 1]}
Path(sys.argv[sys.argv.index("--json") + 1]).write_text(json.dumps({"ratios": ratios, "machine": {"load_average": [1, 2, 3]}}))
'''


def test_bench_harness_repeat_round_robin_three_values_and_median(tmp_path):
    """`python -m tinyscale.bench repeat`: every benchmark once per run, run after run (round
    robin), each key's values in run order and their median, with the machine and torch."""
    from tinyscale.bench import repeat

    for name, key in (("alpha", "a_ratio"), ("beta", "b_ratio")):
        (tmp_path / f"{name}.py").write_text(FAKE_BENCHMARK % key)
    benchmarks = {"alpha": (["--steps", "1"], ("a_ratio",)), "beta": ([], ("b_ratio", "b_other"))}
    out = tmp_path / "bench.json"
    result = repeat(3, str(out), benchmarks, folder=str(tmp_path), work=str(tmp_path / "work"))
    assert (tmp_path / "order.txt").read_text().split() == ["alpha1", "beta1", "alpha2", "beta2", "alpha3", "beta3"]
    assert result["medians"]["a_ratio"] == {"values": [0.9, 0.5, 0.6], "median": 0.6}  # mean 0.667
    assert result["ratios"] == {"a_ratio": 0.6, "b_ratio": 0.6}
    assert [e["missing"] for e in result["log"]] == [[], ["b_other"]] * 3  # a key a benchmark failed to write
    machine = result["machine"]
    assert machine["cores"] >= 1 and machine["cpu_model"] and len(machine["load_average_before"]) == 3
    assert len(machine["load_average_after"]) == 3 and result["torch"] and result["date_utc"]
    assert json.loads(out.read_text()) == result
    from tinyscale.bench import table

    lines = table(result, ["a_ratio", "b_other"]).splitlines()
    assert lines[0].startswith("3 runs, ") and machine["cpu_model"] in lines[0] and result["torch"] in lines[0]
    assert lines[-2:] == ["| `a_ratio` | 0.9 | 0.5 | 0.6 | 0.6 |", "| `b_other` | (none) | (none) | (none) | (none) |"]
