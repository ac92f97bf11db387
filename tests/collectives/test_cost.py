"""The cost model on its own: textbook limits, the lower bound, and the step counter. No processes."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tinyscale.collectives import (
    COSTS,
    Cost,
    measured_steps,
    naive_cost,
    recursive_doubling_cost,
    recursive_halving_doubling_cost,
    ring_cost,
    tree_cost,
)
from tinyscale.collectives.profile import fit_alpha_beta
from tinyscale.dist.comm import Row

FLAT_COSTS = {name: fn for name, fn in COSTS.items() if name != "hierarchical"}


@given(log_n=st.integers(0, 7), chunks=st.integers(1, 1000), element_size=st.sampled_from([2, 4, 8]))
def test_collectives_cost_model_matches_the_textbook_on_powers_of_two(log_n, chunks, element_size):
    n = 2**log_n
    numel = n * chunks  # divisible: no padding, the textbook's own case
    s = numel * element_size
    if n == 1:
        assert all(fn(numel, element_size, 1) == Cost.nothing(1) for fn in FLAT_COSTS.values())
        return
    ring = ring_cost(numel, element_size, n)
    assert ring.bytes_sent == (2 * (n - 1) * s // n,) * n and ring.steps == 2 * (n - 1)
    rhd = recursive_halving_doubling_cost(numel, element_size, n)
    assert rhd.bytes_sent == ring.bytes_sent and rhd.steps == 2 * log_n  # ring's bytes, tree's rounds
    assert recursive_doubling_cost(numel, element_size, n).bytes_sent == (log_n * s,) * n
    assert tree_cost(numel, element_size, n).steps == 2 * log_n
    assert naive_cost(numel, element_size, n).bytes_sent == ((n - 1) * s,) + (s,) * (n - 1)


@given(n=st.integers(2, 100), numel=st.integers(1, 5000), element_size=st.sampled_from([1, 4]))
def test_collectives_no_algorithm_beats_the_lower_bounds(n, numel, element_size):
    # Every element must cross links 2(n-1) times in all (one-way gossip), so some rank
    # sends >= 2(n-1)/n of the message; and with one message per link at a time, what a
    # rank knows at most doubles per latency.
    s = numel * element_size
    for name, fn in FLAT_COSTS.items():
        cost = fn(numel, element_size, n)
        assert sum(cost.bytes_sent) >= 2 * (n - 1) * s, name
        assert cost.max_bytes_sent * n >= 2 * (n - 1) * s, name
        assert cost.alpha_terms >= math.ceil(math.log2(n)), name
        assert cost.alpha_terms >= cost.steps, name
    assert ring_cost(numel, element_size, n).max_bytes_sent * n < 2 * (n - 1) * (s + n * element_size)


def test_collectives_small_messages_favour_few_rounds_large_ones_few_bytes():
    alpha, beta, n = 5e-6, 1 / 20e9, 64  # ~5 us latency, 20 GB/s links
    def fastest(numel):
        return min(FLAT_COSTS, key=lambda a: FLAT_COSTS[a](numel, 4, n).predicted_seconds(alpha, beta))
    assert fastest(256) == "recursive_doubling"  # 1 KiB: latency-bound, 6 rounds beat 126
    assert fastest(64 << 20) in ("ring", "recursive_halving_doubling")  # 256 MiB: bandwidth-bound
    ring, rhd = ring_cost(1 << 20, 4, n), recursive_halving_doubling_cost(1 << 20, 4, n)
    assert ring.beta_bytes == rhd.beta_bytes and ring.steps > rhd.steps


def test_collectives_tree_parents_pay_for_both_children():
    msg = 8
    # 5 ranks: r0 <- {r1, r2}, r1 <- {r3, r4}. r1 sends up once and down twice.
    cost = tree_cost(1, msg, 5)
    assert cost.bytes_sent == (2 * msg, 3 * msg, msg, msg, msg)
    assert cost.steps == 4 and cost.alpha_terms == 2 * (2 + 2) and cost.beta_bytes == 2 * (2 + 2) * msg


def test_collectives_fit_recovers_alpha_and_beta():
    alpha, beta = 3e-5, 2e-9
    rows = []
    for name, fn in FLAT_COSTS.items():
        for numel in (1, 256, 65536, 1 << 20):
            cost = fn(numel, 4, 4)
            rows.append({"algorithm": name, "numel": numel, "element_size": 4, "world_size": 4,
                         "seconds": cost.predicted_seconds(alpha, beta)})
    rows.append({"algorithm": "torch", "seconds": 1.0})  # no cost model: ignored
    fitted_alpha, fitted_beta = fit_alpha_beta(rows)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-9) and fitted_beta == pytest.approx(beta, rel=1e-9)
    with pytest.raises(ValueError, match="at least two"):
        fit_alpha_beta(rows[:1])


def _rows(*batches):
    """Ledger rows of one rank: each batch is a list of (op, peer) issued together."""
    out = []
    for t, batch in enumerate(batches):
        out += [Row(op, 4, 4, "float32", 0.0, True, peer, float(t)) for op, peer in batch]
    return out


def test_collectives_measured_steps_follows_the_critical_path():
    # A chain r0 -> r1 -> r2 -> r3 is 3 rounds; all pairs swapping at once is 1.
    chain = [_rows([("isend", 1)]), _rows([("irecv", 0)], [("isend", 2)]),
             _rows([("irecv", 1)], [("isend", 3)]), _rows([("irecv", 2)])]
    assert measured_steps(chain) == 3
    swap = [_rows([("isend", 1), ("irecv", 1)]), _rows([("isend", 0), ("irecv", 0)])]
    assert measured_steps(swap) == 1
    # r2's message into r0's batch does not wait for r1's: r0's batch is as late as the later.
    fan_in = [_rows([("irecv", 1), ("irecv", 2)]), _rows([("irecv", 3)], [("isend", 0)]),
              _rows([("isend", 0)]), _rows([("isend", 1)])]
    assert measured_steps(fan_in) == 2
    assert measured_steps([[], []]) == 0
    with pytest.raises(ValueError, match="do not match"):
        measured_steps([_rows([("isend", 1)]), []])
