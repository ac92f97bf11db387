"""The benchmarks' shared timing harness (tinyscale.bench): round-robin order, warm-up dropped,
the slowest rank per step, median and spread, and the JSON that `make bench` merges.
Run: `pytest -k bench_harness`."""

from __future__ import annotations

import json

from tinyscale.bench import merge, round_robin, slowest, summary, write_json


def test_bench_harness_round_robin_interleaves_and_drops_warmup():
    calls = []
    times = round_robin({"a": lambda i: calls.append(("a", i)), "b": lambda i: calls.append(("b", i))}, 3,
                        warmup=2, before=lambda: calls.append("barrier"))
    assert calls == [x for i in range(5) for x in ("barrier", ("a", i), "barrier", ("b", i))]
    assert [len(t) for t in times.values()] == [3, 3]


def test_bench_harness_slowest_rank_and_summary():
    assert slowest([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == [3.0, 5.0, 2.5]
    s = summary([3.0, 5.0, 2.5])
    assert (s.median, s.low, s.high, s.n) == (3.0, 2.5, 5.0, 3)


def test_bench_harness_json_files_merge_into_one(tmp_path):
    write_json(str(tmp_path / "a.json"), {"cp_ring_vs_sdpa": 0.5}, seq_len=2048)
    write_json(str(tmp_path / "b.json"), {"ddp_bucketed_vs_torch_2": 0.97})
    write_json(None, {"ignored": 1.0})  # no --json: nothing written
    merged = merge(str(tmp_path / "bench.json"), [str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert merged["ratios"] == {"cp_ring_vs_sdpa": 0.5, "ddp_bucketed_vs_torch_2": 0.97}
    assert json.loads((tmp_path / "bench.json").read_text()) == merged
    assert merged["runs"]["a"]["seq_len"] == 2048 and len(merged["runs"]["a"]["machine"]["load_average"]) == 3
