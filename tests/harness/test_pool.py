"""The rank pool: results in rank order, failures named by rank, hangs caught, skips passed on."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from tinyscale.dist import RankError, RankTimeoutError, comm
from tinyscale.testing import get_pool, run_on_ranks


def _whoami(tag):
    return (tag, dist.get_rank(), dist.get_world_size(), os.getpid())


def _raise_on(bad_rank):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    comm.all_reduce(torch.ones(1))


def _hang_on(bad_rank):
    if dist.get_rank() == bad_rank:
        time.sleep(3600)
    comm.all_reduce(torch.ones(1))


def _skip_everywhere():
    pytest.skip("no GPU here (deliberate)")


def _sum_of(values):
    t = torch.tensor(values, dtype=torch.float64) * (dist.get_rank() + 1)
    comm.all_reduce(t)
    return t


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_harness_results_in_rank_order_and_pool_reused(world_size):
    first = run_on_ranks(_whoami, world_size, "a")
    second = run_on_ranks(_whoami, world_size, "b")
    assert [r[:3] for r in first] == [("a", r, world_size) for r in range(world_size)]
    # The same processes served both runs: the pool is persistent.
    assert [r[3] for r in first] == [r[3] for r in second]


def test_harness_names_the_rank_that_raised_and_recovers():
    pool = get_pool(4)
    run_on_ranks(_whoami, 4, "warm")
    starts = pool.starts
    with pytest.raises(RankError, match="rank 2 of 4 raised ValueError: deliberate failure on rank 2") as info:
        run_on_ranks(_raise_on, 4, 2)
    assert info.value.rank == 2
    assert "--- traceback on rank 2 ---" in str(info.value) and "_raise_on" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    # The next run gets a fresh, working pool.
    assert [r[1] for r in run_on_ranks(_whoami, 4, "after")] == [0, 1, 2, 3]
    assert pool.starts == starts + 1


def test_harness_names_the_hung_rank_within_the_timeout_and_recovers():
    run_on_ranks(_whoami, 3, "warm")  # started: the deadline below needs no time for a start
    t0 = time.monotonic()
    with pytest.raises(RankTimeoutError, match=r"rank 1 of 3 did not finish within 2 s") as info:
        run_on_ranks(_hang_on, 3, 1, timeout_s=2)
    elapsed = time.monotonic() - t0
    assert elapsed < 2 + 5, f"took {elapsed:.1f} s to give up on a 2 s timeout"
    assert "_hang_on" in str(info.value)  # the hung rank's stack is in the message
    assert info.value.outcomes[0].in_collective and not info.value.outcomes[1].in_collective
    assert [r[1] for r in run_on_ranks(_whoami, 3, "after")] == [0, 1, 2]


def test_harness_skip_inside_ranks_skips_the_test():
    with pytest.raises(pytest.skip.Exception, match="no GPU here"):
        run_on_ranks(_skip_everywhere, 2)


def test_harness_rejects_functions_ranks_cannot_import():
    with pytest.raises(ValueError, match="module level"):
        run_on_ranks(lambda: None, 2)


@given(values=st.lists(st.floats(-1e6, 1e6), min_size=0, max_size=7), world_size=st.sampled_from([2, 3, 4]))
def test_harness_hypothesis_examples_reach_every_rank_identically(values, world_size):
    results = run_on_ranks(_sum_of, world_size, values)
    factor = world_size * (world_size + 1) / 2  # sum of (rank + 1)
    expected = torch.tensor(values, dtype=torch.float64) * factor
    for r in results:
        torch.testing.assert_close(r, expected, rtol=1e-15, atol=0)


def test_hung_rank_stack_dump_with_blank_blocks_names_the_main_thread():
    """A dump with empty blocks (blank lines doubled, a trailing newline) once raised IndexError
    inside the hang report, hiding which rank hung; the main thread's block must come back."""
    from tinyscale.dist.procs import main_thread_stack

    dump = ("main thread 0x7f01\n"
            "Thread 0x7f02 (most recent call first):\n  File \"a.py\", line 1 in helper\n\n\n"
            "Current thread 0x7f01 (most recent call first):\n  File \"b.py\", line 9 in body\n\n")
    assert main_thread_stack(dump) == ("Current thread 0x7f01 (most recent call first):\n"
                                       "  File \"b.py\", line 9 in body")
    assert main_thread_stack("main thread 0x1\nno blocks here") == "no blocks here"
