"""tinyscale.pipeline.replay (benchmarks/pipeline.py's bubble gap, notebook 08's bubbles): each
timed step replayed in the simulator on its own costs.

Fed a timeline the simulator itself produced (an executor with no cost outside its actions and
messages), the replay gives the measured bubble exactly; a wait the model lacks shows as a gap;
and one cost per (stage, kind) hides the waits that the actions' spread causes (lessons/08).
On 2 ranks, `StepTimer` records each action once and parts of the step that do not overlap."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from tinyscale.data import synthetic_token_batches
from tinyscale.dist import comm
from tinyscale.models import GPT, GPTConfig
from tinyscale.pipeline import (
    GPTStage, PipelineExecutor, add_communication, gpt_loss, interleaved_1f1b, one_f_one_b, partition_gpt, simulate,
    stages_on_rank, zb_h1,
)
from tinyscale.pipeline.replay import StepTimer, bubbles
from tinyscale.pipeline.schedules import COMM_KINDS, F
from tinyscale.testing import run_on_ranks

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


def _timed_steps():
    """On each rank, one step of ZB-H1 and of interleaved 1F1B (m = 4) after a warm-up step, as
    `StepTimer` records it, with whether the executor and `comm.Work.wait` were restored after."""
    p, rank, m, out = dist.get_world_size(), dist.get_rank(), 4, []
    cfg = GPTConfig(vocab_size=64, max_seq_len=8, n_layer=4, n_head=2, d_model=16, ffn_hidden=24)
    (inputs, targets), = synthetic_token_batches(num_batches=1, batch_size=2 * m, seq_len=8, vocab_size=64, seed=0)
    for schedule, v in ((zb_h1(p, m), 1), (interleaved_1f1b(p, m, 2), 2)):
        model = GPT(cfg, seed=0, dtype=torch.float64)
        stages = {s.stage: GPTStage(model, s) for s in stages_on_rank(partition_gpt(cfg, p, virtual_stages=v), rank)}
        executor = PipelineExecutor(add_communication(schedule), rank, stages, loss_fn=gpt_loss)
        timer, wait = StepTimer(executor), comm.Work.wait
        executor.run(inputs.chunk(m), targets.chunk(m))
        with timer.timing():
            executor.run(inputs.chunk(m), targets.chunk(m))
        restored = not set(vars(executor)) & {"_forward", "_backward", "_weight_grad", "_communicate", "_receive"}
        out.append((executor.actions, timer.computes, timer.holds, timer.waits, timer.send_waits, timer.wall,
                    restored and comm.Work.wait is wait))
    return out


def test_pp_simulator_bench_replay_step_timer_records_each_action_once_and_parts_that_fit_the_step():
    """`StepTimer` (what the benchmark and notebook 08 replay): each compute action once, in the
    rank's order; one hold per send and receive, one wait per receive; compute, holds, waits
    and sends' waits are disjoint parts of the step's wall time; the executor is left as it was."""
    for rank, steps in enumerate(run_on_ranks(_timed_steps, 2)):
        for actions, computes, holds, waits, send_waits, wall, restored in steps:
            assert [a for a, _, _ in computes] == [a for a in actions if a.kind not in COMM_KINDS]
            assert sorted(map(str, (a for a, _ in holds))) == sorted(str(a) for a in actions if a.kind in COMM_KINDS)
            assert [a for a, _ in waits] == [a for a in actions if a.kind.startswith("RECV")]
            assert all(e >= s for _, s, e in computes) and all(t >= 0 for _, t in holds + waits)
            # send_waits is all waits less the receives' (the same floats summed in another
            # order): a few ulps of a few ms below 0 at worst
            assert send_waits >= -1e-12
            parts = sum(e - s for _, s, e in computes) + sum(t for _, t in holds + waits) + send_waits
            assert parts <= wall, f"rank {rank}: the parts ({parts:.6f} s) overlap, more than the step ({wall:.6f} s)"
            assert restored, f"rank {rank}: the executor's methods or comm.Work.wait were not restored"


def test_pp_simulator_bench_replay_receive_waits_keep_the_first_receive_apart_median_over_steps():
    """benchmarks/pipeline.py's `receive_waits` (what lessons/08 compares between AFAB and 1F1B):
    per rank, the first receive's wait and the sum of the others', each the median over steps."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "pipeline.py"
    spec = importlib.util.spec_from_file_location("bench_pipeline", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # rank 0: three steps, the first receive waiting 5, 1, 3 and the others summing to 4, 4, 10
    # (medians 3 and 4; means 3 and 6); rank 1: the first waits nothing, the rest 2, 9, 1
    per_rank = [{"waits": {"1f1b": [[5.0, 1.0, 3.0], [1.0, 4.0, 0.0], [3.0, 2.0, 8.0]]}},
                {"waits": {"1f1b": [[0.0, 2.0], [0.0, 9.0], [0.0, 1.0]]}}]
    assert bench.receive_waits(per_rank, "1f1b") == [(3.0, 4.0), (0.0, 2.0)]
