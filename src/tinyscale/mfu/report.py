"""The profiler's records as a Chrome trace, a summary table, and a torch.profiler trace.

    save_chrome_trace(prof.records, "trace.json")      # chrome://tracing or ui.perfetto.dev
    print_table(prof.records, skip=1)                  # rich table: mean ms and % of the step
    with torch_trace("torch_trace.json"): ...          # torch.profiler, our phases included

The Chrome trace is the JSON "Trace Event Format" (complete events, ph "X", times in
microseconds). One process per rank, four tracks: the steps, the phases, the collectives in
flight (one bar per ledger row, named by op and size) and the exposed communication. On CUDA
a counter track plots allocated and reserved memory. Ranks on one machine share the clock
(time.perf_counter is CLOCK_MONOTONIC on Linux), so `merge_chrome_traces` of every rank's
trace lines them up. Lesson: lessons/06-mfu.md.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from tinyscale.mfu.profiler import StepRecord
from tinyscale.mfu.timeline import CATEGORIES, intersect

_TRACKS = {"step": 0, "phases": 1, "comm in flight": 2, "comm exposed": 3}


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _bar(name: str, track: str, start: float, end: float, pid: int, args: dict | None = None) -> dict:
    event = {"name": name, "cat": track, "ph": "X", "ts": _us(start), "dur": _us(end - start),
             "pid": pid, "tid": _TRACKS[track]}
    if args:
        event["args"] = args
    return event


# --8<-- [start:chrome-trace]
def chrome_trace(records: Sequence[StepRecord], *, rank: int = 0) -> dict:
    """The records of one rank as a Chrome trace (a dict ready for json.dump)."""
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}]
    events += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": track}}
               for track, tid in _TRACKS.items()]
    for r in records:
        parts = {k: round(v * 1e3, 3) for k, v in r.breakdown.as_dict().items()}  # ms, shown on click
        events.append(_bar(f"step {r.index}", "step", r.start, r.end, rank, {"ms": parts, "tokens": r.tokens}))
        for name, spans in r.phases.items():
            events += [_bar(name, "phases", s, e, rank) for s, e in spans]
        for c in r.comm:
            events.append(_bar(f"{c.op} {c.bytes:,} B", "comm in flight", c.start, c.end, rank, {"bytes": c.bytes}))
        blocked = [(c.blocked_from, c.end) for c in r.comm if c.blocked_from is not None]
        events += [_bar("exposed", "comm exposed", s, e, rank) for s, e in intersect(blocked, [(r.start, r.end)])]
        for m in r.memory or []:
            events.append({"name": "memory (MiB)", "ph": "C", "ts": _us(m.time), "pid": rank,
                           "args": {"allocated": m.allocated / 2**20, "reserved": m.reserved / 2**20}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
# --8<-- [end:chrome-trace]


def merge_chrome_traces(traces: Sequence[dict]) -> dict:
    """One trace from several ranks' traces (each made with its own `rank`)."""
    return {"traceEvents": [e for t in traces for e in t["traceEvents"]], "displayTimeUnit": "ms"}


def save_chrome_trace(records_or_trace: Sequence[StepRecord] | dict, path: str | Path, *, rank: int = 0) -> Path:
    """Write a Chrome trace (from records, or an already built/merged trace dict) to `path`."""
    trace = records_or_trace if isinstance(records_or_trace, dict) else chrome_trace(records_or_trace, rank=rank)
    path = Path(path)
    path.write_text(json.dumps(trace))
    return path


def summary(records: Sequence[StepRecord], *, skip: int = 0) -> dict[str, float]:
    """Mean seconds per category over the steps after the first `skip`, plus the step's
    tokens/s and (CUDA) peak memory. The categories' means add up to the mean step."""
    steps = list(records)[skip:]
    if not steps:
        raise ValueError(f"no steps to summarise: {len(records)} recorded, skip={skip}: record more steps "
                         "or skip fewer")
    out = {k: sum(getattr(s.breakdown, k) for s in steps) / len(steps) for k in steps[0].breakdown.as_dict()}
    if all(s.tokens is not None for s in steps):
        out["tokens_per_s"] = sum(s.tokens for s in steps) / sum(s.breakdown.step for s in steps)
    if steps[0].peak_memory is not None:
        out["peak_memory_bytes"] = max(s.peak_memory for s in steps)
    return out


def table(records: Sequence[StepRecord], *, skip: int = 0, title: str = "step profile"):
    """A rich Table of `summary`: mean ms and share of the step per category."""
    from rich.table import Table  # rich renders; the numbers above need no dependency

    s = summary(records, skip=skip)
    t = Table(title=f"{title} (mean of {len(records) - skip} steps)")
    for column in ("category", "ms", "% of step"):
        t.add_column(column, justify="left" if column == "category" else "right")
    for name in CATEGORIES:
        t.add_row(name, f"{s[name] * 1e3:.2f}", f"{100 * s[name] / s['step']:.1f}")
    t.add_row("[bold]step[/bold]", f"[bold]{s['step'] * 1e3:.2f}[/bold]", "100.0", end_section=True)
    t.add_row("comm hidden (overlapped)", f"{s['comm_hidden'] * 1e3:.2f}", f"{100 * s['comm_hidden'] / s['step']:.1f}")
    t.add_row("comm in flight", f"{s['comm_in_flight'] * 1e3:.2f}", f"{100 * s['comm_in_flight'] / s['step']:.1f}")
    if "tokens_per_s" in s:
        t.add_row("tokens/s", f"{s['tokens_per_s']:,.0f}", "")
    peak = s.get("peak_memory_bytes")
    t.add_row("peak memory", "n/a (CUDA only)" if peak is None else f"{peak / 2**20:,.1f} MiB", "")
    return t


def print_table(records: Sequence[StepRecord], *, skip: int = 0, title: str = "step profile") -> None:
    from rich.console import Console

    Console().print(table(records, skip=skip, title=title))


@contextlib.contextmanager
def torch_trace(path: str | Path, *, memory: bool = False) -> Iterator[torch.profiler.profile]:
    """Run the block under torch.profiler (CPU, and CUDA when present) and write its Chrome
    trace to `path` at the end. The StepProfiler's phases appear as `tinyscale/<phase>` ranges.
    memory=True also records allocations (the trace's memory counters; on CUDA, see
    `prof.export_memory_timeline`)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, profile_memory=memory, record_shapes=memory,
                                with_stack=memory) as prof:
        yield prof
    prof.export_chrome_trace(str(path))
