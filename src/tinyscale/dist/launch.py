"""`launch(fn, world_size)`: run a function on N ranks of this machine and get the results.

    def work(scale):                     # module-level: ranks import it by name
        t = torch.ones(3) * (dist.get_rank() + 1)
        ts.dist.comm.all_reduce(t)
        return t * scale
    results = ts.dist.launch(work, 4, 2.0)   # [tensor, tensor, tensor, tensor], rank order

Each rank is a new process (forked from a fork server that has imported torch once, or a
fresh interpreter where CUDA is available: `procs.start_context`) that joins a process
group through a TCPStore this process holds on a free port, so two launches never race
for a port. gloo on CPU; NCCL with ``cuda:local_rank`` when there is a GPU per
rank. A rank's exception is re-raised here as `RankError` naming the rank, with the
remote traceback; a rank that dies or hangs stops every rank, and `launch` raises within
`timeout_s`. It never hangs and leaves no process behind.
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable

import torch.distributed as dist

from tinyscale.dist import procs
from tinyscale.dist.runtime import init_rank

_HOST = "127.0.0.1"


class LaunchError(RuntimeError):
    """A distributed run failed; `rank` is the rank to blame, `outcomes` what every rank did."""

    def __init__(self, message: str, *, rank: int, outcomes: dict[int, procs.Outcome]):
        super().__init__(message)
        self.rank = rank
        self.outcomes = outcomes


class RankError(LaunchError):
    """A rank raised. The original exception is `__cause__` when it could be unpickled."""

    @property
    def remote_traceback(self) -> str:
        return self.outcomes[self.rank].remote_traceback


class RankDiedError(LaunchError):
    """A rank's process exited without reporting (killed, segfault, os._exit)."""


class RankTimeoutError(LaunchError, TimeoutError):
    """A rank did not finish before the deadline."""


def _describe(o: procs.Outcome) -> str:
    if o.status == "ok":
        return "finished"
    if o.status == "skip":
        return f"skipped ({o.message})"
    if o.status == "died":
        sig = f" (signal {-o.exitcode})" if o.exitcode is not None and o.exitcode < 0 else ""
        return f"died with exit code {o.exitcode}{sig}"
    if o.status == "hung":
        where = _innermost_frame(o.stack)
        if o.in_collective:
            return f"waiting in a collective for a peer{where}"
        return f"still running, not in a collective{where}" if o.stack else "still running (no answer)"
    first_line = o.message.strip().splitlines()[0] if o.message.strip() else ""
    return f"raised {o.exc_type}: {first_line}"


def _innermost_frame(stack: str) -> str:
    """" (at file:line in func)" for the innermost frame of a faulthandler dump."""
    for line in stack.splitlines()[1:]:  # most recent call first
        line = line.strip()
        if line.startswith("File "):
            return f" (at {line.removeprefix('File ')})"
    return ""


def raise_for_outcomes(outcomes: dict[int, procs.Outcome], timeout_s: float) -> list:
    """Return the values in rank order if every rank finished; otherwise raise, blaming one rank.

    Blame goes, in order, to: the first rank that raised an error of its own (not a
    collective that failed because a peer vanished), a rank that died, a rank that never
    answered, and only then to a rank whose error was caused by a peer.
    """
    world_size = len(outcomes)
    ordered = [outcomes[r] for r in range(world_size)]
    if all(o.status == "ok" for o in ordered):
        return [o.value for o in ordered]
    if all(o.status == "skip" for o in ordered):
        import pytest  # ranks raised pytest's Skipped, so pytest is here

        pytest.skip(ordered[0].message)  # the test is skipped, as it would be on one process

    # --8<-- [start:blame]
    own = sorted((o for o in ordered if o.status == "error" and not o.collateral), key=lambda o: o.at)
    died = [o for o in ordered if o.status == "died"]
    # Among silent ranks, one busy outside torch.distributed is the cause; ranks inside a
    # collective are waiting for it.
    hung = sorted((o for o in ordered if o.status == "hung"), key=lambda o: o.in_collective)
    peer = sorted((o for o in ordered if o.status == "error"), key=lambda o: o.at)
    mixed_skip = [o for o in ordered if o.status == "skip"]
    busy = [o for o in hung if not o.in_collective]  # silent, and not waiting for anyone
    # Nobody failed on its own, yet some ranks finished while the rest wait in (or timed
    # out of) a collective: a finished rank most likely made fewer collectives than the others.
    waiting = [o for o in ordered if o.status == "error" or (o.status == "hung" and o.in_collective)]
    left_early = [o for o in ordered if o.status == "ok"] if waiting and not (own or died or busy) else []
    culprit = (own or died or busy or left_early or hung or peer or mixed_skip)[0]
    # --8<-- [end:blame]

    others = "\n".join(f"  rank {o.rank}: {_describe(o)}" for o in ordered)
    if culprit.status == "hung":
        stuck = [o for o in hung if not o.in_collective] or hung
        names = ", ".join(str(o.rank) for o in stuck)
        head = (f"rank {names} of {world_size} did not finish within {timeout_s:g} s "
                f"(hung, or waiting for a peer that is)")
        cls = RankTimeoutError
    elif culprit.status == "died":
        head = f"rank {culprit.rank} of {world_size} {_describe(culprit)} without reporting"
        cls = RankDiedError
    elif culprit.status == "ok":
        names = ", ".join(str(o.rank) for o in left_early)
        head = (f"rank {names} of {world_size} finished while the other ranks failed waiting in a "
                f"collective: did it skip a collective the others made?")
        cls = RankError
    elif culprit.status == "skip":
        head = f"rank {culprit.rank} of {world_size} skipped but other ranks did not: ranks disagree"
        cls = RankError
    else:
        head = f"rank {culprit.rank} of {world_size} {_describe(culprit)}"
        cls = RankError
    message = f"{head}\nall ranks:\n{others}"
    if culprit.status == "hung" and culprit.stack:
        message += f"\n\n--- stack of rank {culprit.rank} at the deadline ---\n{culprit.stack}"
    if culprit.remote_traceback:
        message += f"\n\n--- traceback on rank {culprit.rank} ---\n{culprit.remote_traceback.rstrip()}"
    raise cls(message, rank=culprit.rank, outcomes=outcomes) from culprit.exception


# --8<-- [start:rank-main]
def _rank_main(rank, world_size, port, backend, timeout_s, fn, args, results, parent_pid, stack_dir, env):
    procs.adopt_environment(env)
    procs.die_with_parent(parent_pid)
    procs.enable_stack_dumps(stack_dir, rank)
    # torchrun's variables, so code written for torchrun (and `init()`) sees a familiar world.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=_HOST, MASTER_PORT=str(port))
    try:
        store = dist.TCPStore(_HOST, port, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        init_rank(rank, world_size, local_rank=rank, local_world_size=world_size,
                  backend=backend, timeout_s=pg_timeout(timeout_s), store=store)
    except BaseException as exc:  # noqa: BLE001 - report, never die silently
        results.put(procs.encode_exception(rank, 0, exc))
        return
    message = procs.encode_result(rank, 0, fn, args, {})
    results.put(message)
    try:
        if message[2] == "ok":
            # Nobody leaves before everyone is done: a fast rank that exits while a slow one
            # is still connecting (gloo's full mesh) would make the slow one fail.
            dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a failed run may leave the group unusable; exiting is enough
        pass
# --8<-- [end:rank-main]


# --8<-- [start:pg-timeout]
def pg_timeout(timeout_s: float) -> float:
    """The process-group timeout for a run with this deadline.

    Shorter than the deadline, so that ranks stuck in a collective behind a hung peer
    raise (and report) before the caller gives up: the silent rank is then the hung one.
    """
    return max(1.0, 0.75 * timeout_s)
# --8<-- [end:pg-timeout]


def check_picklable(fn: Callable, args: tuple) -> None:
    try:
        pickle.dumps((fn, args))
    except Exception as exc:  # noqa: BLE001
        raise ValueError(
            f"launch: {getattr(fn, '__qualname__', fn)!r} or its arguments cannot be sent to "
            f"spawned ranks ({exc}). Ranks import the function by name: define it at module "
            "level (not in a notebook cell, not a lambda or a nested function) and pass "
            "picklable arguments."
        ) from exc


def launch(fn: Callable, world_size: int, *args, backend: str = "auto", timeout_s: float = 120.0) -> list:
    """Run ``fn(*args)`` on `world_size` ranks; return the results in rank order.

    Raises `RankError` (a rank raised), `RankDiedError` (a rank exited without a word) or
    `RankTimeoutError` (not done within `timeout_s` seconds, spawning included). Every
    rank process is gone when this returns or raises.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"launch: world_size must be a positive int, got {world_size!r}")
    if timeout_s <= 0:
        raise ValueError(f"launch: timeout_s must be positive, got {timeout_s!r}")
    # --8<-- [start:launch]
    check_picklable(fn, args)
    deadline = time.monotonic() + timeout_s
    ctx = procs.start_context()
    # The parent holds the rendezvous store on a free port: no fixed port, no race for one.
    store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    results = ctx.Queue()
    stack_dir = tempfile.mkdtemp(prefix="tinyscale-stacks-")
    ranks = [
        ctx.Process(target=_rank_main, name=f"tinyscale-rank{r}",
                    args=(r, world_size, store.port, backend, timeout_s, fn, args, results, os.getpid(),
                          stack_dir, procs.child_environment()))
        for r in range(world_size)
    ]
    try:
        for p in ranks:
            p.start()
        outcomes = procs.collect(results, ranks, task_id=0, deadline=deadline)
        procs.dump_stacks(ranks, outcomes, stack_dir)
        if all(o.status == "ok" for o in outcomes.values()):
            for p in ranks:  # they are tearing down their process groups; let them finish
                p.join(timeout=10)
    finally:
        # Runs on every exit, Ctrl-C and pytest-timeout included (which still propagate).
        procs.kill_all(ranks)
        results.close()
        shutil.rmtree(stack_dir, ignore_errors=True)
        del store
    return raise_for_outcomes(outcomes, timeout_s)
    # --8<-- [end:launch]
