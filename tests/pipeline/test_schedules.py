"""The four schedules judged by the simulator: bubbles equal their closed forms, peak in-flight
micro-batches equal 1F1B's and GPipe's, ZB-H1 beats 1F1B at the same memory, every generated
schedule runs once each action and never deadlocks.

Cost model behind every closed form: communication is free (sends take no time, latency 0)
and each kind has one duration on every stage. Then AFAB's and 1F1B's makespan is
(m+p-1)(F+BW), so their bubble is (p-1)/(m+p-1) whatever F and BW are (drawn here); the
interleaved schedule's is (p-1)/(v m+p-1) for any per-chunk F and BW (F = BW = 1/v per
chunk keeps a micro-batch's time through a rank at 1, to compare makespans with 1F1B's);
ZB-H1's is (p-1)/(3m+p-1) with F = B = W = 1 and m >= p.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tinyscale.pipeline.schedules import (
    BW, COMPUTE_KINDS, RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, W, add_communication, afab,
    format_schedule, interleaved_1f1b, one_f_one_b, zb_h1,
)
from tinyscale.pipeline.simulator import simulate

stages = st.integers(2, 8)
microbatches = st.integers(1, 32)
durations = st.integers(1, 4)


@given(p=stages, m=microbatches, f=durations, bw=durations)
@example(p=8, m=1, f=1, bw=1)
@example(p=2, m=32, f=1, bw=1)
def test_pp_afab_bubble_matches_formula(p, m, f, bw):
    sim = simulate(add_communication(afab(p, m)), {F: f, BW: bw})
    assert sim.makespan == (m + p - 1) * (f + bw)
    assert sim.bubble_fraction == Fraction(p - 1, m + p - 1)


@given(p=stages, m=microbatches)
def test_pp_afab_holds_every_microbatch(p, m):
    sim = simulate(add_communication(afab(p, m)))
    assert sim.peak_in_flight == {s: m for s in range(p)}


@given(p=stages, m=microbatches, f=durations, bw=durations)
@example(p=8, m=1, f=1, bw=1)
@example(p=8, m=32, f=1, bw=2)
def test_pp_1f1b_bubble_matches_formula(p, m, f, bw):
    sim = simulate(add_communication(one_f_one_b(p, m)), {F: f, BW: bw})
    assert sim.makespan == (m + p - 1) * (f + bw)
    assert sim.bubble_fraction == Fraction(p - 1, m + p - 1)


@given(p=stages, m=microbatches)
@example(p=4, m=3)  # m < p: the first stage is capped by m
def test_pp_1f1b_peak_in_flight_is_min_of_p_minus_s_and_m(p, m):
    sim = simulate(add_communication(one_f_one_b(p, m)))
    assert sim.peak_in_flight == {s: min(p - s, m) for s in range(p)}


def test_pp_1f1b_order_by_hand():
    """p = 2, m = 3 written out: one warm-up forward on stage 0, none on stage 1."""
    assert format_schedule(one_f_one_b(2, 3)) == (
        "rank 0: 0F0 0F1 0BW0 0F2 0BW1 0BW2\n"
        "rank 1: 1F0 1BW0 1F1 1BW1 1F2 1BW2")


def test_pp_1f1b_timeline_by_hand():
    """p = 2, m = 2, F = BW = 1, drawn on paper: makespan 2(m+p-1) = 6, each rank idle 2 slots."""
    sim = simulate(add_communication(one_f_one_b(2, 2)), {F: 1, BW: 1})
    compute = [[(str(t.action), t.start) for t in line if t.action.is_compute] for line in sim.timelines]
    assert compute == [[("0F0", 0), ("0F1", 1), ("0BW0", 3), ("0BW1", 5)],
                       [("1F0", 1), ("1BW0", 2), ("1F1", 3), ("1BW1", 4)]]
    assert sim.makespan == 6 and sim.bubble_fraction == Fraction(1, 3)


@given(p=stages, rounds=st.integers(1, 4), v=st.integers(1, 4))
@example(p=8, rounds=4, v=4)
def test_pp_interleaved_bubble_matches_formula(p, rounds, v):
    m = p * rounds  # micro-batches in rounds of p: the schedule requires it
    per_chunk = Fraction(1, v)  # a micro-batch's forward through a rank's v chunks takes 1, as without chunks
    sim = simulate(add_communication(interleaved_1f1b(p, m, v)), {F: per_chunk, BW: per_chunk})
    assert sim.makespan == 2 * m + Fraction(2 * (p - 1), v)  # the bubble shrinks v times
    assert sim.bubble_fraction == Fraction(p - 1, v * m + p - 1)


@given(p=stages, rounds=st.integers(1, 4), v=st.integers(1, 4), f=durations, bw=durations)
def test_pp_interleaved_bubble_matches_formula_for_any_chunk_costs(p, rounds, v, f, bw):
    m = p * rounds
    sim = simulate(add_communication(interleaved_1f1b(p, m, v)), {F: f, BW: bw})
    assert sim.makespan == (v * m + p - 1) * (f + bw)
    assert sim.bubble_fraction == Fraction(p - 1, v * m + p - 1)


@given(p=stages, rounds=st.integers(1, 4), v=st.integers(1, 4))
def test_pp_interleaved_peak_in_flight_per_rank(p, rounds, v):
    """Rank r runs 2(p-r-1) + (v-1)p warm-up forwards, then one more before its first backward:
    that many chunk activations at the peak (each a 1/v slice of a stage's), capped at m v."""
    m = p * rounds
    sim = simulate(add_communication(interleaved_1f1b(p, m, v)))
    assert sim.peak_in_flight_per_rank == [min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p)]


@pytest.mark.parametrize("p, m", [(2, 3), (4, 6), (3, 1)])
def test_pp_interleaved_rejects_microbatches_not_multiple_of_stages(p, m):
    with pytest.raises(ValueError, match=f"num_microbatches={m} .* multiple of num_stages={p}"):
        interleaved_1f1b(p, m, 2)


def test_pp_interleaved_places_chunk_c_of_rank_r_at_stage_c_p_plus_r():
    schedule = interleaved_1f1b(3, 6, 2)
    for rank, actions in enumerate(schedule):
        assert {a.stage for a in actions} == {rank, rank + 3}
        assert {a.chunk(3) for a in actions} == {0, 1}


@given(p=stages, m=microbatches)
@example(p=8, m=1)
@example(p=8, m=32)
def test_pp_zero_bubble_beats_1f1b_at_equal_peak_memory(p, m):
    """F = B = W = 1, so 1F1B's full backward BW = B + W = 2 (the simulator's default costs)."""
    zb = simulate(add_communication(zb_h1(p, m)))
    base = simulate(add_communication(one_f_one_b(p, m)))
    assert max(zb.peak_in_flight.values()) == max(base.peak_in_flight.values()) == min(p, m)
    # A micro-batch is in flight until its W: deferring W by s fills every stage up to 1F1B's
    # stage-0 peak ("the same number of in-flight micro-batches on all stages", sec. 2.1).
    assert zb.peak_in_flight == {s: min(p, m) for s in range(p)}
    assert zb.bubble_fraction < base.bubble_fraction
    assert sum(zb.busy) == sum(base.busy)  # same work, split differently


@given(p=stages, m=microbatches)
def test_pp_zero_bubble_bubble_matches_formula_when_m_at_least_p(p, m):
    m = max(m, p)
    sim = simulate(add_communication(zb_h1(p, m)), {F: 1, B: 1, W: 1})
    assert sim.makespan == 3 * m + p - 1
    assert sim.bubble_fraction == Fraction(p - 1, 3 * m + p - 1)


def test_pp_zero_bubble_defers_w_by_stage():
    """Stage s runs W(i - s) right after B(i); the last stage runs B and W back to back."""
    schedule = zb_h1(3, 4)
    assert format_schedule(schedule).splitlines() == [
        "rank 0: 0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3",
        "rank 1: 1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3",
        "rank 2: 2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3"]


GENERATORS = {
    "afab": lambda p, m, v: afab(p, m),
    "1f1b": lambda p, m, v: one_f_one_b(p, m),
    "interleaved_1f1b": lambda p, m, v: interleaved_1f1b(p, m, v),
    "zb_h1": lambda p, m, v: zb_h1(p, m),
}


@pytest.mark.parametrize("name", GENERATORS)
@given(p=stages, m=microbatches, v=st.integers(1, 3))
def test_pp_simulator_generated_schedules_run_each_action_once(name, p, m, v):
    if name == "interleaved_1f1b":
        m = -(-m // p) * p  # round up to a multiple of p
    else:
        v = 1
    compute = GENERATORS[name](p, m, v)
    backward = (B, W) if name == "zb_h1" else (BW,)
    expected = Counter(Action(s, kind, i) for s in range(p * v) for kind in (F, *backward) for i in range(m))
    assert Counter(a for actions in compute for a in actions) == expected
    assert all(a.kind in COMPUTE_KINDS for actions in compute for a in actions)
    lowered = add_communication(compute)
    simulate(lowered)  # raises ScheduleError on a deadlock or a broken dependency
    kinds = Counter(a.kind for actions in lowered for a in actions)
    boundaries = p * v - 1  # every micro-batch crosses each boundary once each way
    assert kinds[SEND_F] == kinds[RECV_F] == kinds[SEND_B] == kinds[RECV_B] == m * boundaries
