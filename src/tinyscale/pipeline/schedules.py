"""Pipeline schedules as data: each rank's ordered list of actions, from pure functions.

A schedule says, for every pipeline rank, in which order it runs the forward (F) and backward
passes of every micro-batch on every model stage it holds. It is data, not a loop: the
simulator (`simulator.py`) judges it (bubble, peak in-flight activations, deadlock), the
renderer (`render.py`) draws it and one executor runs any of them. PyTorch's
torch.distributed.pipelining writes its schedules the same way; the action strings here
read like its: `0F3` is stage 0's forward of micro-batch 3.

| generator | paper | bubble (free communication) |
| --- | --- | --- |
| `afab` | GPipe, Huang et al. 2019: all forwards, then all backwards | (p-1)/(m+p-1), any F, BW |
| `one_f_one_b` | PipeDream-Flush / Megatron (Narayanan et al. 2021, sec. 2.2.1) | (p-1)/(m+p-1), any F, BW |
| `interleaved_1f1b` | Megatron's interleaved schedule (Narayanan et al. 2021, sec. 2.2.2) | (p-1)/(v m+p-1), any chunk F, BW |
| `zb_h1` | ZB-H1, Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", sec. 2.1) | (p-1)/(3m+p-1), F=B=W, m>=p |

(Each kind one duration on every stage; the simulator checks these exactly, `tests/pipeline`.)

Names: p = `num_stages` pipeline ranks, m = `num_microbatches`, v = `virtual_stages` (model
chunks per rank). The model is cut into p*v stages; stage s lives on rank s % p as its chunk
s // p (Megatron's placement), so with v = 1 stage and rank are the same number.

Generators return compute actions only (F, BW, or B and W); `add_communication` lowers a
schedule by inserting the sends and receives between ranks, so the compute order stays
readable. The lesson: lessons/08-pipeline-parallel.md; the tests: `pytest tests/pipeline`.
"""

from __future__ import annotations

import dataclasses

F, B, W, BW = "F", "B", "W", "BW"  # forward; input-grad backward; weight-grad backward; both at once
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE_KINDS = (F, B, W, BW)
COMM_KINDS = (SEND_F, RECV_F, SEND_B, RECV_B)

Schedule = list  # list[list[Action]]: one ordered action list per pipeline rank


@dataclasses.dataclass(frozen=True)
class Action:
    """One step of one rank: `kind` of micro-batch `microbatch` on model stage `stage`.

    `stage` counts model stages (0 .. p*v-1); the rank running it is `stage % p` and the chunk
    on that rank `stage // p` (`chunk(num_ranks)`). Communication kinds name the stage that
    does them: `1RECV_F3` is stage 1 receiving micro-batch 3's activation from stage 0,
    `1SEND_B3` is stage 1 sending micro-batch 3's input gradient back to stage 0."""

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE_KINDS + COMM_KINDS:
            raise ValueError(f"Action.kind={self.kind!r} is not one of {COMPUTE_KINDS + COMM_KINDS}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"Action stage={self.stage} and microbatch={self.microbatch} must be >= 0")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    def chunk(self, num_ranks: int) -> int:
        """Which of its rank's model chunks this stage is (0 without interleaving)."""
        return self.stage // num_ranks

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")


def afab(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every rank runs all m forwards, then all m backwards (in reverse order, so the
    last forward's activations, the freshest, are consumed first). Simple, and every stage
    holds all m micro-batches' activations at the peak."""
    _check_sizes(num_stages, num_microbatches)
    m = num_microbatches
    return [[Action(s, F, i) for i in range(m)] + [Action(s, BW, i) for i in reversed(range(m))]
            for s in range(num_stages)]


# --8<-- [start:one-f-one-b]
def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B: stage s runs p-s-1 warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards. Same bubble as GPipe, but stage s never
    holds more than min(p - s, m) micro-batches' activations (GPipe: m)."""
    _check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    schedule = []
    for s in range(p):
        warmup = min(p - s - 1, m)  # forwards in flight before the first backward can arrive
        actions = [Action(s, F, i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: forward of i + warmup, backward of i
            actions += [Action(s, F, i + warmup), Action(s, BW, i)]
        actions += [Action(s, BW, i) for i in range(m - warmup, m)]  # cool-down
        schedule.append(actions)
    return schedule
# --8<-- [end:one-f-one-b]


def interleaved_1f1b(num_stages: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron's interleaved 1F1B: each rank holds v chunks (stages r, r+p, ..., r+(v-1)p).

    A rank walks its forwards in rounds of p micro-batches: micro-batches 0..p-1 through
    chunk 0, then the same p through chunk 1, ..., then the next p micro-batches; backwards
    walk the chunks in reverse. Rank r runs 2(p-r-1) + (v-1)p forwards before its first
    backward (capped at m v), then alternates, then drains. The rounds of p are why m must be
    a multiple of p. The bubble shrinks v times, at v times the point-to-point messages.

    With free communication p-r-1 warm-up forwards would give the same bubble with less
    memory; the p-r-1 extra ones keep the rank busy while messages are in flight (try
    `simulate(..., latency=...)` on both)."""
    _check_sizes(num_stages, num_microbatches)
    p, m, v = num_stages, num_microbatches, virtual_stages
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"virtual_stages={v!r} must be a positive int")
    if m % p:
        raise ValueError(f"interleaved 1F1B needs num_microbatches={m} to be a multiple of "
                         f"num_stages={p} (it walks micro-batches in rounds of {p}): use "
                         f"{(m // p + 1) * p} micro-batches, or another schedule")
    total = m * v  # (chunk, micro-batch) pairs per rank

    def position(k: int) -> tuple[int, int]:  # k-th forward (or backward) -> (chunk, micro-batch)
        return (k // p) % v, (k // (p * v)) * p + k % p

    schedule = []
    for r in range(p):
        def fwd(k: int) -> Action:
            chunk, mb = position(k)
            return Action(chunk * p + r, F, mb)

        def bwd(k: int) -> Action:
            chunk, mb = position(k)
            return Action((v - 1 - chunk) * p + r, BW, mb)  # backwards visit chunks last-first

        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        actions = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [fwd(k + warmup), bwd(k)]
        actions += [bwd(k) for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule


# --8<-- [start:zb-h1]
def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with each backward split into B (input gradient, on the critical path
    between stages) and W (weight gradient, needed only by the optimizer step).

    Stage s keeps 1F1B's order of F and B, with min(p - s, m) forwards before its first B so
    B starts as early as it can; each W is deferred by s micro-batches, W(i - s) right after
    B(i), and the deferred W's fill the cool-down, where 1F1B's stages wait. So every stage
    holds at most min(p, m) micro-batches (F done, W not yet), 1F1B's peak on stage 0, and
    with F = B = W and m >= p the bubble is (p-1)/(3m+p-1): a third of the idle time of 1F1B
    (whose backward is BW = B + W). With fewer micro-batches than stages there are too few W's
    to fill the cool-down, and the bubble is larger, though still below 1F1B's."""
    _check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    schedule = []
    for s in range(p):
        first = min(p - s, m)  # forwards before the first B
        actions = [Action(s, F, i) for i in range(first)]
        next_w = 0
        for i in range(m):
            actions.append(Action(s, B, i))
            if i - s >= next_w:  # W deferred by s micro-batches
                actions.append(Action(s, W, next_w))
                next_w += 1
            if i + first < m:
                actions.append(Action(s, F, i + first))
        actions += [Action(s, W, i) for i in range(next_w, m)]
        schedule.append(actions)
    return schedule
# --8<-- [end:zb-h1]


def stage_ranks(schedule: Schedule) -> dict[int, int]:
    """Which rank runs each stage, read from where its compute actions are; a stage found on
    two ranks is an error (its weights live in one place)."""
    where: dict[int, int] = {}
    first: dict[int, Action] = {}
    for rank, actions in enumerate(schedule):
        for action in actions:
            if not action.is_compute:
                continue
            if where.setdefault(action.stage, rank) != rank:
                raise ValueError(f"stage {action.stage} has compute on rank {where[action.stage]} "
                                 f"({first[action.stage]}) and on rank {rank} ({action}): "
                                 "a stage's actions belong to one rank")
            first.setdefault(action.stage, action)
    return where


# --8<-- [start:lowering]
def add_communication(schedule: Schedule) -> Schedule:
    """Lower a compute-only schedule: a receive just before each compute action whose input
    comes from another rank, a send just after each one whose output goes to another rank.
    Neighbouring stages on the same rank (none with Megatron's placement unless p = 1) pass
    tensors in memory, without messages."""
    for rank, actions in enumerate(schedule):
        for action in actions:
            if not action.is_compute:
                raise ValueError(f"rank {rank} already has communication ({action}): "
                                 "add_communication takes a compute-only schedule")
    where = stage_ranks(schedule)
    last = max(where, default=0)
    lowered = []
    for rank, actions in enumerate(schedule):
        out = []
        for a in actions:
            s, i = a.stage, a.microbatch
            prev_remote = s > 0 and where.get(s - 1, rank) != rank
            next_remote = s < last and where.get(s + 1, rank) != rank
            if a.kind == F and prev_remote:
                out.append(Action(s, RECV_F, i))  # the activation from stage s-1
            if a.kind in (B, BW) and next_remote:
                out.append(Action(s, RECV_B, i))  # the output's gradient from stage s+1
            out.append(a)  # W needs nothing from other ranks and sends nothing
            if a.kind == F and next_remote:
                out.append(Action(s, SEND_F, i))
            if a.kind in (B, BW) and prev_remote:
                out.append(Action(s, SEND_B, i))
        lowered.append(out)
    return lowered
# --8<-- [end:lowering]


def format_schedule(schedule: Schedule) -> str:
    """One line per rank: the actions in order, e.g. `rank 0: 0F0 0F1 0BW0 ...`."""
    return "\n".join(f"rank {r}: " + " ".join(map(str, actions)) for r, actions in enumerate(schedule))
