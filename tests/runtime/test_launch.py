"""`launch`: fresh ranks per call; results in rank order; every failure named and bounded in time."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from tinyscale.dist import RankDiedError, RankError, RankTimeoutError, comm, info, launch, procs

# Seconds to start the ranks, inside each timeout below: a fork from the fork server takes
# milliseconds; spawning fresh interpreters (GPU machines, TINYSCALE_START_METHOD=spawn)
# imports torch in each, ~5 s for 3 ranks on 2 cores.
START_S = 2 if procs.start_context().get_start_method() == "forkserver" else 8


def _rank_and_sum(offset):
    t = torch.tensor([float(dist.get_rank() + offset)])
    comm.all_reduce(t)
    me = info()
    return me.rank, me.world_size, me.backend, t.item()


def _fail_on_rank_two():
    if dist.get_rank() == 2:
        raise KeyError("rank two is unhappy")
    comm.all_reduce(torch.ones(4))


def _die_on_rank_one():
    if dist.get_rank() == 1:
        os._exit(7)
    comm.all_reduce(torch.ones(4))


def _hang_on_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(3600)
    comm.all_reduce(torch.ones(4))


def _shared_helper(cmdline: list[str]) -> bool:
    """multiprocessing's resource tracker and fork server: started once, shared by every launch."""
    text = " ".join(cmdline)
    return "resource_tracker" in text or "forkserver" in text


def _live_children() -> set[int]:
    """Our live child processes, minus multiprocessing's shared helpers."""
    out = set()
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE and not _shared_helper(c.cmdline()):
                out.add(c.pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture
def no_orphans():
    """Fails the test if it leaves a live process behind (pooled ranks from other tests are exempt)."""
    before = _live_children()
    yield
    left = _live_children() - before
    assert not left, f"launch left processes behind: {sorted(left)}"


def test_dist_launch_returns_results_in_rank_order(no_orphans):
    results = launch(_rank_and_sum, 3, 10)
    assert [r[:2] for r in results] == [(0, 3), (1, 3), (2, 3)]
    assert {r[2] for r in results} == {"gloo" if not torch.cuda.is_available() else results[0][2]}
    assert all(r[3] == 10 + 11 + 12 for r in results)


def test_dist_launch_names_the_rank_that_raised_with_its_traceback(no_orphans):
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 2 of 4 raised KeyError") as err:
        launch(_fail_on_rank_two, 4, timeout_s=60)
    assert time.monotonic() - t0 < 60
    assert "--- traceback on rank 2 ---" in str(err.value)
    assert "_fail_on_rank_two" in err.value.remote_traceback
    assert isinstance(err.value.__cause__, KeyError)


def test_dist_launch_reports_a_rank_that_died_without_a_word(no_orphans):
    with pytest.raises(RankDiedError, match=r"rank 1 of 2 died with exit code 7"):
        launch(_die_on_rank_one, 2, timeout_s=60)


@pytest.fixture(scope="module")
def start_s() -> float:
    """Seconds to start 2 ranks now, measured: a launch (after one that starts the fork server, if
    this is the first) of a function that makes one collective, doubled. A fixed allowance failed
    under heavy load (the fork server's own start took 11 to 20 s at load 18); idle, this is
    well under START_S, and the two launches cost about what that allowance did."""
    launch(_rank_and_sum, 2, 0)
    t0 = time.monotonic()
    launch(_rank_and_sum, 2, 0)
    return max(1.0, 2 * (time.monotonic() - t0))


def test_dist_launch_stops_a_hung_rank_within_the_timeout(no_orphans, start_s):
    t0 = time.monotonic()
    timeout_s = round(start_s + 4, 1)  # 4 s past the ranks' start, as before with the fixed allowance
    with pytest.raises(RankTimeoutError, match=rf"rank 0 of 2 did not finish within {timeout_s:g} s"):
        launch(_hang_on_rank_zero, 2, timeout_s=timeout_s)
    assert time.monotonic() - t0 < timeout_s + 5


def test_dist_launch_rejects_bad_arguments_before_spawning():
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        launch(_rank_and_sum, 0, 1)
    with pytest.raises(ValueError, match="module level"):
        launch(lambda: 1, 2)


def _skip_a_collective_on_rank_one():
    if dist.get_rank() != 1:  # rank 1 returns at once; the others wait for it in vain
        comm.all_reduce(torch.ones(4))


def test_dist_launch_blames_a_rank_that_left_its_peers_waiting(no_orphans, start_s):
    with pytest.raises(RankError, match=r"rank 1 of 3 finished while the other ranks failed"):
        # the waiting ranks raise at the process group's timeout, 0.75 x this (past the start of 3
        # ranks: 1.5 x the measured start of 2, plus 3 s, as before with the fixed allowance); were
        # they still waiting at the deadline, they would be hung inside a collective, and the
        # finished rank is blamed all the same
        launch(_skip_a_collective_on_rank_one, 3, timeout_s=round(1.5 * start_s + 3, 1))


def _getenv(name):
    return os.environ.get(name)


def test_dist_launch_ranks_see_the_parents_environment_as_it_is_now(monkeypatch, no_orphans):
    launch(_getenv, 1, "HOME")  # the fork server (if used) now exists, with the environment of now
    monkeypatch.setenv("TINYSCALE_TEST_SET_LATER", "after the ranks' server started")
    assert launch(_getenv, 2, "TINYSCALE_TEST_SET_LATER") == ["after the ranks' server started"] * 2


_ORPHAN_SCRIPT = """
import os, sys, time
from tinyscale.dist import launch

def hang(folder):
    open(os.path.join(folder, str(os.getpid())), "w").close()
    time.sleep(3600)

if __name__ == "__main__":
    launch(hang, 2, sys.argv[1], timeout_s=600)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_dist_launch_ranks_die_with_the_process_that_launched_them(tmp_path):
    """SIGKILL to the launcher (no finally runs): its ranks, forked or spawned, still exit."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "launcher.py"
    script.write_text(_ORPHAN_SCRIPT)
    folder = tmp_path / "pids"
    folder.mkdir()
    launcher = subprocess.Popen([sys.executable, str(script), str(folder)])
    try:
        deadline = time.monotonic() + 60  # a fresh interpreter imports torch, then starts 2 ranks
        while len(list(folder.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        ranks = [int(p.name) for p in folder.iterdir()]
        assert len(ranks) == 2, "the ranks never started"
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    deadline = time.monotonic() + 5  # the watchdog polls every 0.5 s; PDEATHSIG is at once
    while not all(_gone(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in ranks if not _gone(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their launcher"
