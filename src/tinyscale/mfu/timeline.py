"""Where a training step's time went: interval arithmetic over one step's timeline (pure Python).

The profiler (profiler.py) records, on one rank, for one step [t0, t1]:

- phase intervals: when the host was inside forward, backward or the optimizer step;
- communication rows from the comm ledger: each call's *in-flight* interval (issue to
  completion, as the host saw it) and its *blocked* interval, the time the host spent waiting
  for it (a synchronous collective: the whole call; an async one: inside `Work.wait()`).

From these, every instant of the step gets exactly one category:

    comm_exposed   the host was blocked on communication (nothing else ran on it)
    forward, backward, optimizer
                   inside that phase and not blocked on communication
    other          outside every phase (data loading, logging, `loss.item()`, ...)

so forward + backward + optimizer + comm_exposed + other = the step time, exactly. Besides:

    comm_hidden    in flight while the host was *not* blocked: hidden behind other work
                   by overlap. An upper bound: a row's completion time is when the host
                   learned of it (`wait()` returned), which may be after the bytes landed.

This is the host's view, the one a CPU (gloo) run has. On a GPU, collectives run as kernels on
their own stream and `wait()` returns as soon as the compute stream is told to wait, so the true
split there is per kernel: NCCL kernel time not overlapped by compute kernels is exposed (the
complement of the "communication computation overlap" that Holistic Trace Analysis,
github.com/facebookresearch/HolisticTraceAnalysis, computes from torch.profiler traces).
Lesson: lessons/06-mfu.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

Span = tuple[float, float]  # (start, end), seconds on one clock (time.perf_counter)

PHASES = ("forward", "backward", "optimizer")
CATEGORIES = (*PHASES, "comm_exposed", "other")


def union(spans: Iterable[Span]) -> list[Span]:
    """Sorted, disjoint spans covering exactly the same instants."""
    merged: list[list[float]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def intersect(a: Iterable[Span], b: Iterable[Span]) -> list[Span]:
    """Instants in both a and b."""
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Iterable[Span], b: Iterable[Span]) -> list[Span]:
    """Instants in a and not in b."""
    a, b = union(a), union(b)
    out = []
    for start, end in a:
        cursor = start
        for s, e in b:
            if e <= cursor or s >= end:
                continue
            if s > cursor:
                out.append((cursor, s))
            cursor = max(cursor, e)
        if cursor < end:
            out.append((cursor, end))
    return out


def length(spans: Iterable[Span]) -> float:
    return sum(e - s for s, e in union(spans))


# --8<-- [start:breakdown]
@dataclasses.dataclass(frozen=True)
class StepBreakdown:
    """Seconds of one step by category; the first six add up to `step` (see the module docstring)."""

    step: float
    forward: float
    backward: float
    optimizer: float
    comm_exposed: float
    other: float
    comm_hidden: float
    comm_in_flight: float

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def breakdown(step: Span, phases: dict[str, list[Span]], in_flight: list[Span],
              blocked: list[Span]) -> StepBreakdown:
    """Split the step [t0, t1] into categories; everything is clipped to the step."""
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise ValueError(f"unknown phase names {sorted(unknown)}: use {', '.join(PHASES)}")
    window = [step]
    blocked = intersect(blocked, window)
    flying = intersect(in_flight, window)
    seconds, covered = {}, list(blocked)
    for name in PHASES:
        # The waits inside a phase are communication, not compute; should phases overlap (they
        # do not in the profiler), an instant goes to the first phase in PHASES order.
        spans = subtract(intersect(phases.get(name, []), window), covered)
        seconds[name] = length(spans)
        covered = union([*covered, *spans])
    return StepBreakdown(
        step=step[1] - step[0],
        forward=seconds["forward"],
        backward=seconds["backward"],
        optimizer=seconds["optimizer"],
        comm_exposed=length(blocked),
        other=length(subtract(window, covered)),
        comm_hidden=length(subtract(flying, blocked)),
        comm_in_flight=length(flying),
    )
# --8<-- [end:breakdown]
