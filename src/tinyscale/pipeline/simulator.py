"""Simulate a lowered pipeline schedule: dependencies, deadlock, timelines, bubble, memory.

Each rank runs its action list in order. A compute action starts when its rank is free and
its inputs are there; a receive waits until the matching send has been issued; sends are
non-blocking (like isend), their data arriving `latency` after the send. `message_cost` is
what each send and each receive holds its rank for (posting it, copying the frame, the
transport's work on a shared core): 0 by default, as in the closed forms; measured on CPU
ranks it is what the measured bubble shows beyond the compute (benchmarks/pipeline.py).
A schedule that breaks a dependency within a rank (a backward before its forward, a forward
with no receive for its input) or in which every remaining rank waits on a receive that
nobody will send (deadlock) raises `ScheduleError` naming the actions.

Measured on the result (`Simulation`):
- makespan: when the last rank finishes;
- bubble fraction: idle share of p x makespan, 1 - sum(busy) / (p * makespan), where busy
  is each rank's compute time (communication counts as idle);
- peak in-flight micro-batches per stage: forwards done whose backward has not yet freed
  their activations (a BW, or the W of a split backward: W still reads the saved inputs).

Costs: a mapping kind -> duration (defaults F = B = W = 1, BW = B + W = 2) or a function of
the action (for per-stage measured costs). With exact numbers (int, Fraction) every result
is exact, which is what lets the tests compare bubbles with closed forms using ==.
Try it: `python -m tinyscale.pipeline.render 1f1b 4 8`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from fractions import Fraction
from numbers import Rational

from tinyscale.pipeline.schedules import (
    B, BW, COMM_KINDS, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, Schedule, stage_ranks,
)

DEFAULT_COSTS = {F: 1, B: 1, W: 1, BW: 2}


class ScheduleError(ValueError):
    """The schedule cannot run: a broken dependency, a missing message, a deadlock."""


@dataclasses.dataclass(frozen=True)
class TimedAction:
    rank: int
    action: Action
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Simulation:
    timelines: list[list[TimedAction]]  # per rank, in execution order (communication included)
    makespan: float
    busy: list[float]  # per rank: time spent computing
    peak_in_flight: dict[int, int]  # per stage
    peak_in_flight_per_rank: list[int]  # over all the rank's chunks (interleaving)

    @property
    def num_ranks(self) -> int:
        return len(self.timelines)

    # --8<-- [start:bubble]
    @property
    def bubble_fraction(self):
        """Idle share of the ranks' time; a Fraction when the costs were exact."""
        if not self.makespan:
            return 0
        total = self.num_ranks * self.makespan
        if isinstance(total, Rational):
            return 1 - Fraction(sum(self.busy)) / total
        return 1 - sum(self.busy) / total
    # --8<-- [end:bubble]


def matching_send(a: Action) -> Action:
    """The send a receive waits for: stage s's RECV_F comes from s-1, its RECV_B from s+1."""
    return Action(a.stage - 1, SEND_F, a.microbatch) if a.kind == RECV_F else Action(a.stage + 1, SEND_B, a.microbatch)


def matching_receive(a: Action) -> Action:
    """The receive a send feeds: stage s's SEND_F goes to s+1, its SEND_B to s-1."""
    return Action(a.stage + 1, RECV_F, a.microbatch) if a.kind == SEND_F else Action(a.stage - 1, RECV_B, a.microbatch)


def _check_layout(schedule: Schedule) -> tuple[dict[int, int], int, set[int]]:
    """Stage -> rank, the number of stages and the micro-batches; every action once, on its rank."""
    try:
        where = stage_ranks(schedule)
    except ValueError as e:
        raise ScheduleError(str(e)) from None
    if not where:
        raise ScheduleError("the schedule has no compute actions")
    seen: dict[Action, int] = {}
    for rank, actions in enumerate(schedule):
        for a in actions:
            if a in seen:
                raise ScheduleError(f"{a} appears twice (ranks {seen[a]} and {rank}): every action runs once")
            seen[a] = rank
            if where.get(a.stage) != rank:
                raise ScheduleError(f"{a} is on rank {rank}, but stage {a.stage}'s compute is on rank "
                                    f"{where.get(a.stage)}: an action runs where its stage lives")
    num_stages = max(where) + 1
    missing = sorted(set(range(num_stages)) - set(where))
    if missing:
        raise ScheduleError(f"stages {missing} have no actions (stages run 0..{num_stages - 1})")
    return where, num_stages, {a.microbatch for a in seen}


def _check_message_order(schedule: Schedule, where: dict[int, int]) -> None:
    """Between two ranks, messages are matched in the order posted (NCCL has no tags), so
    each rank must receive from a peer in the order that peer sends to it."""
    sent: dict[tuple[int, int], list[Action]] = {}
    for rank, actions in enumerate(schedule):
        for a in actions:
            if a.kind in (SEND_F, SEND_B):
                sent.setdefault((rank, where[matching_receive(a).stage]), []).append(a)
    position: dict[tuple[int, int], int] = {}
    for rank, actions in enumerate(schedule):
        for a in actions:
            if a.kind in (RECV_F, RECV_B):
                pair = (where[matching_send(a).stage], rank)
                k = position.get(pair, 0)
                expected = sent[pair][k]
                if expected != matching_send(a):
                    raise ScheduleError(f"rank {rank} receives {a} from rank {pair[0]}, whose next message "
                                        f"to it is {expected}: messages between two ranks are matched in "
                                        "the order sent, so receive in that order")
                position[pair] = k + 1


def simulate(schedule: Schedule, costs: Mapping[str, float] | Callable[[Action], float] | None = None,
             *, latency: float = 0, message_cost: float | Callable[[Action], float] = 0) -> Simulation:
    """Run `schedule` (per-rank lists, lowered by `add_communication`) on the given costs."""
    if callable(costs):
        cost_of = costs
    else:
        table = {**DEFAULT_COSTS, **(costs or {})}
        cost_of = lambda a: table[a.kind]  # noqa: E731
    message_cost_of = message_cost if callable(message_cost) else (lambda a: message_cost)  # noqa: E731
    where, num_stages, microbatches = _check_layout(schedule)
    num_ranks = len(schedule)
    done: dict[Action, float] = {}  # executed actions -> end time
    sent: dict[Action, float] = {}  # issued sends -> time their data arrives
    all_actions = {a for actions in schedule for a in actions}
    pc, clock = [0] * num_ranks, [0] * num_ranks
    timelines: list[list[TimedAction]] = [[] for _ in range(num_ranks)]
    busy = [0] * num_ranks
    held = dict.fromkeys(range(num_stages), 0)
    peak = dict.fromkeys(range(num_stages), 0)
    held_rank, peak_rank = [0] * num_ranks, [0] * num_ranks

    def need(a: Action, rank: int, dep: Action, why: str) -> float:
        """End time of `dep`, which must already have run on this rank, or ScheduleError."""
        if dep in done:
            return done[dep]
        later = dep in schedule[rank][pc[rank]:]
        raise ScheduleError(f"rank {rank}: {a} runs before {why} {dep}"
                            + (" (it comes later on that rank)" if later else f" (missing from rank {rank}'s list)"))

    def ready_time(a: Action, rank: int) -> float | None:
        """When `a`'s inputs are available; None while a receive waits for its send."""
        s, i = a.stage, a.microbatch
        if a.kind in (RECV_F, RECV_B):
            if (a.kind == RECV_F and s == 0) or (a.kind == RECV_B and s == num_stages - 1):
                raise ScheduleError(f"rank {rank}: {a} has no neighbouring stage to receive from")
            send = matching_send(a)
            if send not in all_actions:
                raise ScheduleError(f"rank {rank}: {a} waits for {send}, which no rank sends")
            return sent.get(send)
        if a.kind == F:
            if s == 0:
                return 0
            if where[s - 1] == rank:
                return need(a, rank, Action(s - 1, F, i), "its input, the forward")
            return need(a, rank, Action(s, RECV_F, i), "its input's receive")
        if a.kind in (B, BW):
            t = need(a, rank, Action(s, F, i), "its forward")
            if s == num_stages - 1:  # the last stage's forward computed the loss
                return t
            if where[s + 1] == rank:
                nxt = Action(s + 1, BW, i) if Action(s + 1, BW, i) in all_actions else Action(s + 1, B, i)
                return max(t, need(a, rank, nxt, "its output's gradient, the backward"))
            return max(t, need(a, rank, Action(s, RECV_B, i), "its output gradient's receive"))
        if a.kind == W:
            return need(a, rank, Action(s, B, i), "its input-gradient backward")
        if a.kind == SEND_F:
            return need(a, rank, Action(s, F, i), "the forward it sends")
        backward = Action(s, BW, i) if Action(s, BW, i) in all_actions else Action(s, B, i)
        return need(a, rank, backward, "the backward it sends")  # SEND_B

    progress = True
    while progress:
        progress = False
        for rank in range(num_ranks):
            while pc[rank] < len(schedule[rank]):
                a = schedule[rank][pc[rank]]
                ready = ready_time(a, rank)
                if ready is None:
                    break
                start = max(clock[rank], ready)
                end = start + (message_cost_of(a) if a.kind in COMM_KINDS else cost_of(a))
                if a.kind in (SEND_F, SEND_B):
                    sent[a] = end + latency
                if a.kind == F:
                    held[a.stage] += 1
                    held_rank[rank] += 1
                    peak[a.stage] = max(peak[a.stage], held[a.stage])
                    peak_rank[rank] = max(peak_rank[rank], held_rank[rank])
                if a.kind in (BW, W):  # the micro-batch's activations on this stage are freed
                    held[a.stage] -= 1
                    held_rank[rank] -= 1
                if a.kind not in COMM_KINDS:
                    busy[rank] += end - start
                done[a] = end
                clock[rank] = end
                timelines[rank].append(TimedAction(rank, a, start, end))
                pc[rank] += 1
                progress = True

    blocked = [(r, schedule[r][pc[r]]) for r in range(num_ranks) if pc[r] < len(schedule[r])]
    if blocked:
        waits = "; ".join(f"rank {r} waits at {a} for {matching_send(a)}" for r, a in blocked)
        raise ScheduleError(f"deadlock: {waits}")
    for a in (a for actions in schedule for a in actions):
        if a.kind in (SEND_F, SEND_B):
            recv = matching_receive(a)
            if recv not in done:
                raise ScheduleError(f"{a} is never received: no rank runs {recv}")
    _check_message_order(schedule, where)
    for s in range(num_stages):
        for i in sorted(microbatches):
            if Action(s, F, i) not in done:
                raise ScheduleError(f"{Action(s, F, i)} is missing: stage {s} never runs micro-batch {i}'s forward")
            split = Action(s, B, i) in done, Action(s, W, i) in done
            if (Action(s, BW, i) in done) == any(split) or (any(split) and not all(split)):
                raise ScheduleError(f"micro-batch {i} on stage {s} needs exactly one backward: "
                                    f"{Action(s, BW, i)}, or {Action(s, B, i)} and {Action(s, W, i)}")
    return Simulation(timelines, max(clock), busy, peak, peak_rank)
