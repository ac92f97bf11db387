"""Replay measured pipeline steps in the simulator, each on that step's own costs.

`StepTimer(executor)` records one step of a `PipelineExecutor` on its rank, inside
`with timer.timing():`: each compute action's start and end (`time.perf_counter`, a clock the
ranks of one machine share) and what each message held its rank for:
- a send: its share of the time from the start of its run of messages to the run's first
  receive (frames built, isends issued), in every run, not only runs of sends alone (the last
  stage's SEND_B shares a run with a RECV_F);
- a receive: its time less what it spent waiting for the data (in `comm.Work.wait`), the wait
  the simulator derives from the schedule and the message latency (kept apart, in `waits`);
the time spent waiting for sends (`send_waits`: on gloo the executor waits for a run's sends
after its receives where no rank can block so; the simulator's sends never wait); and the step's
wall time on the rank (`wall`): what is in none of these is host work that the simulator has no
term for (the executor's loop between actions).
`message_latency` measures that latency: half the median round trip of one message.

`bubbles(schedule, steps, latency)` sets each step's measured bubble, 1 - busy / (p x makespan)
as the simulator defines it, beside `simulate` on that step's own costs (the replay), and on
one cost per (stage, kind) (the medians over steps; a hold's mean). The replay is exact on a
timeline the simulator made; what it leaves out (a rank losing its core mid-step, host work
between actions outside any message) shows as the gap. One cost per (stage, kind) leaves out
how the actions' times vary: in a balanced pipeline each wait follows the slower of two
ranks, which the medians do not show (lessons/08).

Used by benchmarks/pipeline.py and notebooks/pp_ranks.py; test: `pytest -k bench_replay`.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from tinyscale.dist import comm
from tinyscale.pipeline.schedules import SEND_B, SEND_F, Action, Schedule
from tinyscale.pipeline.simulator import Simulation, simulate

Computes = Sequence[tuple[Action, float, float]]  # one rank's (action, start, end), seconds
Holds = Sequence[tuple[Action, float]]  # one rank's (send or receive, seconds it held the rank)


class StepTimer:
    """Times an executor's compute actions and message holds while `timing()` is open."""

    def __init__(self, executor) -> None:
        self.executor = executor
        self.computes: list[tuple[Action, float, float]] = []
        self.holds: list[tuple[Action, float]] = []
        self.waits: list[tuple[Action, float]] = []  # each receive's wait for its data
        self.wall = self.send_waits = 0.0
        self._waited: list[float] = []  # seconds in comm.Work.wait during the current receive
        self._first_receive: float | None = None
        self._wrappers = {}
        for method in ("_forward", "_backward", "_weight_grad"):
            def timed(a, run=getattr(executor, method)):
                start = time.perf_counter()
                run(a)
                self.computes.append((a, start, time.perf_counter()))
            self._wrappers[method] = timed

        def communicate(actions, run=executor._communicate):
            start = time.perf_counter()
            self._first_receive = None
            run(actions)
            sends = [a for a in actions if a.kind in (SEND_F, SEND_B)]
            end = self._first_receive or time.perf_counter()
            self.holds.extend((a, (end - start) / len(sends)) for a in sends)

        def receive(a, run=executor._receive):
            start = time.perf_counter()
            self._first_receive = self._first_receive or start
            self._waited.clear()
            run(a)
            self.holds.append((a, time.perf_counter() - start - sum(self._waited)))
            self.waits.append((a, sum(self._waited)))
        self._wrappers["_communicate"], self._wrappers["_receive"] = communicate, receive

    @contextlib.contextmanager
    def timing(self):
        """Time what runs inside (one step; each `timing()` starts a new record)."""
        self.computes, self.holds, self.waits = [], [], []
        wait, waited, total = comm.Work.wait, self._waited, [0.0]

        def timed_wait(work):
            start = time.perf_counter()
            wait(work)
            waited.append(time.perf_counter() - start)
            total[0] += waited[-1]
        vars(self.executor).update(self._wrappers)  # instance attributes shadow the methods
        comm.Work.wait = timed_wait
        start = time.perf_counter()
        try:
            yield self
        finally:
            self.wall = time.perf_counter() - start
            self.send_waits = total[0] - sum(t for _, t in self.waits)
            comm.Work.wait = wait
            for method in self._wrappers:
                del vars(self.executor)[method]


def message_latency(numel: int, trips: int = 30) -> float:
    """One-way seconds of a message of `numel` float32 between ranks 0 and 1: half the median
    round trip of a blocking send and receive (call it on every rank)."""
    rank, buffer, trip = dist.get_rank(), torch.zeros(numel), []
    for _ in range(trips + 2):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
        elif rank == 1:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
        trip.append(time.perf_counter() - start)
    return statistics.median(trip[2:]) / 2


def measured_bubble(computes: Sequence[Computes]) -> float:
    """1 - busy / (p x makespan) of one step, from each rank's timed compute actions."""
    start = min(s for line in computes for _, s, _ in line)
    end = max(e for line in computes for _, _, e in line)
    return 1 - sum(e - s for line in computes for _, s, e in line) / (len(computes) * (end - start))


def replay(schedule: Schedule, computes: Sequence[Computes], holds: Sequence[Holds] = (),
           latency: float = 0.0) -> Simulation:
    """`simulate` on one step's own costs: each compute action's measured time, each send and
    receive's measured hold (0 where none was recorded), each message arriving `latency` after its send."""
    cost = {a: e - s for line in computes for a, s, e in line}
    hold = {a: t for line in holds for a, t in line}
    return simulate(schedule, cost.__getitem__, latency=latency, message_cost=lambda a: hold.get(a, 0.0))


def bubbles(schedule: Schedule, steps: Sequence[tuple[Sequence[Computes], Sequence[Holds]]],
            latency: float = 0.0) -> dict:
    """Each step (per rank: its computes, its holds) measured and simulated, medians over steps:
    `measured`; `replayed` (`replay`, each step on its own costs) and `gap`, the median of the
    steps' measured minus replayed, in points; `typical`, the simulator on one cost per (stage,
    kind) (the median compute time, the mean hold: a few receives hold their rank for
    milliseconds, most for 0.2 ms, and each rank must be charged the total), `free` the same with
    free messages; `costs` and `holds`, those per-(stage, kind) costs in seconds."""
    measured, replayed, durations, held = [], [], {}, {}
    for computes, holds in steps:
        measured.append(measured_bubble(computes))
        replayed.append(float(replay(schedule, computes, holds, latency).bubble_fraction))
        for line in computes:
            for a, s, e in line:
                durations.setdefault((a.stage, a.kind), []).append(e - s)
        for line in holds:
            for a, t in line:
                held.setdefault((a.stage, a.kind), []).append(t)
    cost = {key: statistics.median(d) for key, d in durations.items()}
    hold = {key: statistics.mean(d) for key, d in held.items()}
    typical = simulate(schedule, lambda a: cost[(a.stage, a.kind)], latency=latency,
                       message_cost=lambda a: hold.get((a.stage, a.kind), 0.0))
    free = simulate(schedule, lambda a: cost[(a.stage, a.kind)])
    return {"measured": statistics.median(measured), "replayed": statistics.median(replayed),
            "gap": 100 * statistics.median(x - y for x, y in zip(measured, replayed)),
            "typical": float(typical.bubble_fraction), "free": float(free.bubble_fraction),
            "costs": cost, "holds": hold, "steps": len(measured)}
