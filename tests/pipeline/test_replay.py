"""tinyscale.pipeline.replay (benchmarks/pipeline.py's bubble gap, notebook 08's bubbles): each
timed step replayed in the simulator on its own costs.

Fed a timeline the simulator itself produced (an executor with no cost outside its actions and
messages), the replay gives the measured bubble exactly; a wait the model lacks shows as a gap;
and one cost per (stage, kind) hides the waits that the actions' spread causes (lessons/08)."""

from __future__ import annotations

import random

import pytest

from tinyscale.pipeline import add_communication, one_f_one_b, simulate
from tinyscale.pipeline.replay import bubbles
from tinyscale.pipeline.schedules import COMM_KINDS, F

SCHEDULE = add_communication(one_f_one_b(2, 8))


def _steps(costs, holds, latency, delay=0.0):
    """One timed step per cost table, as `StepTimer` records it on each rank, from the
    simulator's timelines; `delay` shifts rank 0's compute after its first (a wait the model
    does not have; rank 0 runs the step's last action, so the step grows by `delay`)."""
    steps = []
    for cost, hold in zip(costs, holds):
        sim = simulate(SCHEDULE, cost, latency=latency, message_cost=hold)
        computes, held = [], []
        for r, line in enumerate(sim.timelines):
            work = [t for t in line if t.action.kind not in COMM_KINDS]
            shift = [delay if r == 0 and k > 0 else 0.0 for k in range(len(work))]
            computes.append([(t.action, t.start + d, t.end + d) for t, d in zip(work, shift)])
            held.append([(t.action, hold(t.action)) for t in line if t.action.kind in COMM_KINDS])
        steps.append((computes, held))
    return steps


def _jittered(steps: int, seed: int = 0):
    """Per step, each action's cost drawn once: F 1 and BW 2, each times uniform(0.7, 1.3) (on
    the 2 shared CPU cores the measured quartiles lie 23 to 34 % of the median apart)."""
    rng = random.Random(seed)

    def step_cost():
        table = {}
        return lambda a: table.setdefault(a, (1.0 if a.kind == F else 2.0) * rng.uniform(0.7, 1.3))
    return [step_cost() for _ in range(steps)]


def test_pp_simulator_bench_replay_gives_the_measured_bubble_and_a_missing_wait_as_the_gap():
    costs = _jittered(9)
    holds = [lambda a, k=k: 0.05 + 0.02 * ((a.microbatch + k) % 3) for k in range(9)]
    exact = bubbles(SCHEDULE, _steps(costs, holds, 0.1), latency=0.1)
    # the same simulation twice, on the same floats: only rounding of sums of ~60 costs near 1 (~1e-14)
    assert exact["gap"] == pytest.approx(0.0, abs=1e-9)
    assert exact["replayed"] == pytest.approx(exact["measured"], abs=1e-12)
    # One cost per (stage, kind) hides the waits that the spread causes (each wait follows the
    # slower rank): 17.4 % against 20.0 % here; the replay sees them.
    assert exact["typical"] < exact["replayed"] - 0.02
    late = bubbles(SCHEDULE, _steps(costs, holds, 0.1, delay=1.0), latency=0.1)
    # rank 0 idles 1.0 more (a wait the model lacks) in a step about 30 long: the measured bubble
    # grows by about its busy share over the longer step, 0.8 / 31 = 2.6 points; the replay does not
    assert late["replayed"] == pytest.approx(exact["replayed"], abs=1e-12)
    assert late["gap"] > 1.0
