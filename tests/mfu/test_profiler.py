"""The step profiler: its categories add up to the step, exposed and hidden communication
follow their definitions, and its traces are valid Chrome traces."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from tinyscale.dist import comm
from tinyscale.mfu import (
    CATEGORIES,
    PHASES,
    StepProfiler,
    breakdown,
    chrome_trace,
    merge_chrome_traces,
    summary,
)
from tinyscale.mfu.report import save_chrome_trace, table, torch_trace
from tinyscale.mfu.timeline import intersect, length, subtract, union
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import run_on_ranks


def _plain_loop(prof: StepProfiler, steps: int, *, hooks: bool) -> list[float]:
    """Train the small GPT; return each step's wall time measured outside the profiler."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("small"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 128))
    if hooks:
        prof.attach(model, optimizer)
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        with prof.step(tokens=x.numel()):
            if hooks:
                model(x, x).backward()
                optimizer.step()
            else:
                with prof.phase("forward"):
                    loss = model(x, x)
                with prof.phase("backward"):
                    loss.backward()
                with prof.phase("optimizer"):
                    optimizer.step()
                    optimizer.zero_grad()
        walls.append(time.perf_counter() - start)
        optimizer.zero_grad()  # with hooks: outside the optimizer phase, so "other" (microseconds)
    return walls


@pytest.mark.parametrize("hooks", [False, True], ids=["phases", "hooks"])
def test_profiler_categories_add_up_to_step_time(hooks):
    prof = StepProfiler()
    walls = _plain_loop(prof, 3, hooks=hooks)
    for record, wall in zip(prof.records, walls):
        b = record.breakdown
        measured = b.forward + b.backward + b.optimizer + b.comm_exposed
        # Within 5% of the step timed from outside: only the profiler's own bookkeeping between
        # phases (tens of microseconds against a ~20 ms step) is in neither.
        assert measured == pytest.approx(wall, rel=0.05)
        assert min(b.forward, b.backward, b.optimizer) > 0
        assert sum(getattr(b, k) for k in CATEGORIES) == pytest.approx(b.step, rel=1e-9)  # by construction
        assert record.memory is None and record.peak_memory is None  # CPU: no memory counters


def test_profiler_breakdown_of_a_scripted_step():
    # Step 0..10 s: forward 0-3, backward 3-8 (an async op in flight 4-9, waited for 7.5-9),
    # optimizer 9-9.5, a synchronous collective 9.5-10.
    b = breakdown((0.0, 10.0), {"forward": [(0, 3)], "backward": [(3, 8)], "optimizer": [(9, 9.5)]},
                  in_flight=[(4, 9), (9.5, 10)], blocked=[(7.5, 9), (9.5, 10)])
    assert (b.forward, b.backward, b.optimizer) == (3, 4.5, 0.5)  # backward loses its 0.5 s wait
    assert (b.comm_exposed, b.comm_hidden, b.comm_in_flight, b.other) == (2.0, 3.5, 5.5, 0.0)


spans = st.lists(st.tuples(st.floats(0, 10), st.floats(0, 3)).map(lambda p: (p[0], p[0] + p[1])), max_size=6)


@given(phases=st.fixed_dictionaries({name: spans for name in PHASES}), flying=spans, blocked=spans)
def test_profiler_breakdown_partitions_the_step(phases, flying, blocked):
    b = breakdown((1.0, 9.0), phases, flying, blocked)
    # Sums of at most ~30 float differences of numbers <= 13: error ~1e-14.
    assert sum(getattr(b, k) for k in CATEGORIES) == pytest.approx(b.step, abs=1e-9)
    window = [(1.0, 9.0)]
    assert b.comm_exposed == pytest.approx(length(intersect(blocked, window)), abs=1e-9)
    assert b.comm_hidden == pytest.approx(length(subtract(intersect(flying, window), blocked)), abs=1e-9)
    assert length(union(flying)) >= b.comm_hidden - 1e-9


def _communicating_step(compute_s: float) -> dict:
    """One profiled step on each rank: an async all-reduce issued before compute (overlap),
    waited for after it, then a synchronous all-reduce (fully exposed)."""
    prof = StepProfiler()
    grad = torch.ones(1 << 16)
    with prof.step():
        with prof.phase("backward"):
            work = comm.all_reduce(grad, async_op=True)
            until = time.perf_counter() + compute_s
            a = torch.randn(64, 64)
            while time.perf_counter() < until:  # compute while the all-reduce is in flight
                a = torch.tanh(a @ a)
            work.wait()
        dist.barrier()  # both ranks reach the synchronous collective together
        with prof.phase("optimizer"):
            comm.all_reduce(torch.ones(8))
    record = prof.records[0]
    trace = chrome_trace(prof.records, rank=dist.get_rank())
    return {"breakdown": record.breakdown.as_dict(), "comm": [(c.op, c.bytes, c.start, c.end, c.blocked_from)
                                                            for c in record.comm], "trace": trace}


def test_profiler_exposed_and_hidden_comm_on_two_ranks():
    results = run_on_ranks(_communicating_step, 2, 0.05)
    for result in results:
        b, rows = result["breakdown"], result["comm"]
        assert [r[:2] for r in rows] == [("all_reduce", 4 << 16), ("all_reduce", 32)]
        (_, _, a_start, a_end, a_wait), (_, _, s_start, s_end, s_blocked) = rows
        assert s_blocked == s_start  # synchronous: blocked from issue to return
        assert a_start < a_wait <= a_end  # async: blocked only inside wait()
        assert b["comm_exposed"] == pytest.approx((a_end - a_wait) + (s_end - s_start), rel=1e-9)
        assert b["comm_hidden"] == pytest.approx(a_wait - a_start, rel=1e-9)
        assert b["comm_hidden"] >= 0.05  # in flight during the whole 50 ms of compute
        assert sum(b[k] for k in CATEGORIES) == pytest.approx(b["step"], rel=1e-9)
    merged = merge_chrome_traces([r["trace"] for r in results])
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}
    names = {e["name"] for e in merged["traceEvents"] if e.get("cat") == "comm in flight"}
    assert names == {"all_reduce 262,144 B", "all_reduce 32 B"}


def test_profiler_chrome_trace_and_table(tmp_path):
    prof = StepProfiler()
    with torch_trace(tmp_path / "torch.json"):
        _plain_loop(prof, 2, hooks=False)
    path = save_chrome_trace(prof.records, tmp_path / "trace.json")
    events = json.loads(path.read_text())["traceEvents"]
    bars = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in bars if e["cat"] == "step"] == ["step 0", "step 1"]
    assert [e["name"] for e in bars if e["cat"] == "phases"] == ["forward", "backward", "optimizer"] * 2
    assert all(e["dur"] >= 0 and {"ts", "pid", "tid"} <= e.keys() for e in bars)
    torch_names = {e.get("name") for e in json.loads((tmp_path / "torch.json").read_text())["traceEvents"]}
    assert {"tinyscale/forward", "tinyscale/backward", "tinyscale/optimizer"} <= torch_names
    s = summary(prof.records)
    assert s["tokens_per_s"] == pytest.approx(2 * 256 / (s["step"] * 2), rel=1e-9)
    assert table(prof.records).row_count == len(CATEGORIES) + 5


def test_profiler_misuse_raises_and_disabled_is_a_noop():
    prof = StepProfiler()
    with pytest.raises(RuntimeError, match="outside a step"), prof.phase("forward"):
        pass
    with prof.step():
        with pytest.raises(ValueError, match="unknown"), prof.phase("loss"):
            pass
        with prof.phase("forward"), pytest.raises(RuntimeError, match="do not nest"), prof.phase("backward"):
            pass
    with pytest.raises(ValueError, match="skip"):
        summary(prof.records, skip=5)
    off = StepProfiler(enabled=False)
    with off.step(), off.phase("forward"):
        pass
    assert off.records == []
