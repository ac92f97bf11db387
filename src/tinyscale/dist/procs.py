"""Rank processes on one machine: start them, hear from them, and stop them all.

Shared by `launch` (one function, fresh processes) and `tinyscale.testing.RankPool`
(persistent processes that run many functions). The rules both keep:

* a rank's exception travels to the caller as text (type, message, remote traceback) plus
  the pickled exception when it pickles;
* the caller never waits past its deadline: ranks that have not answered by then are
  named as hung, and every rank is killed;
* when one rank fails, the others get a short grace period to report (they usually fail
  too, because a peer vanished from a collective), then all are stopped;
* a rank process dies with its parent (PR_SET_PDEATHSIG and a watchdog thread), so no
  orphan survives a killed test run;
* rank processes start from a fork server that has imported torch and tinyscale once, on a
  machine without CUDA (a fresh interpreter per rank costs seconds: `start_context`).
"""

from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

# Errors raised by a rank only because a *peer* failed or stalled: the peer is the story.
# --8<-- [start:collateral]
_COLLATERAL_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "timed out",
    "Timed out",
    "Timeout",
    "timeout",
    "Broken pipe",
    "NCCL communicator was aborted",
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "StepFailed",  # tinyscale's engine: another rank's forward or backward raised
)
# --8<-- [end:collateral]


@dataclass
class Outcome:
    """What one rank reported for one task."""

    rank: int
    status: str  # "ok", "error", "skip", "died", "hung"
    value: object = None  # the return value ("ok")
    exc_type: str = ""
    message: str = ""
    remote_traceback: str = ""
    exception: BaseException | None = None
    exitcode: int | None = None
    stack: str = ""  # for "hung": the main thread's Python stack when the deadline passed
    at: float = field(default_factory=time.monotonic)

    @property
    def in_collective(self) -> bool:
        """A hung rank whose stack is inside torch.distributed is waiting for a peer."""
        return "torch/distributed" in self.stack

    @property
    def collateral(self) -> bool:
        text = f"{self.exc_type} {self.message}"
        return self.status == "error" and any(m in text for m in _COLLATERAL_MARKERS)


# ----------------------------------------------------------------------------- child side


def die_with_parent(parent_pid: int) -> None:
    """Make this process exit when `parent_pid` (the process that asked for it) goes away.

    Started by spawn, our OS parent is `parent_pid`; started by the fork server, it is the
    server, which exits when `parent_pid` does. Either way the kernel kills us when the OS
    parent dies (Linux), and a watchdog also checks that `parent_pid` still exists."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    os_parent = os.getppid()

    def watch() -> None:  # portable fallback, and covers a parent that died before prctl
        while True:
            try:
                os.kill(parent_pid, 0)  # signal 0: only "does it exist"
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:  # exists, owned by someone else (cannot happen to our parent)
                pass
            if os.getppid() != os_parent:  # reparented: the OS parent died
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="tinyscale-parent-watch", daemon=True).start()


# --8<-- [start:start-method]
START_METHOD_ENV = "TINYSCALE_START_METHOD"  # "spawn" or "forkserver": overrides the choice below
# torch._dynamo too: torch.optim imports it on a rank's first optimizer step (its
# `_disable_dynamo` wrapper), 1.35 s of CPU and 213 modules per rank process, once per fork here.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "tinyscale", "tinyscale.testing"]


def add_preload(*modules: str) -> None:
    """Also import `modules` in the forkserver, so that every rank forked from it has them.
    Only calls made before the first rank starts count (the server imports once, at start)."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def start_context():
    """The multiprocessing context rank processes start from.

    "spawn" starts a fresh interpreter per rank, which imports torch and tinyscale again:
    about 2 s of CPU per rank, 5 s for 3 ranks on 2 cores. "forkserver" imports them once,
    in a server process, and forks each rank from it in milliseconds. Forking is safe there
    because the server only imports; it is not used where CUDA is available, since a
    process forked after the CUDA driver is initialised cannot use CUDA (and GPU machines
    have the cores to spawn). Ranks do not inherit the parent's environment from the
    server, so `child_environment` carries it. ``TINYSCALE_START_METHOD=spawn`` or
    ``forkserver`` overrides the choice; any other value is a ValueError.
    """
    method = os.environ.get(START_METHOD_ENV) or ""
    if method not in ("", "spawn", "forkserver"):
        raise ValueError(f"{START_METHOD_ENV}={method!r}: use 'spawn' or 'forkserver' (or leave it unset)")
    if not method:
        import torch  # the caller has it imported already

        usable = "forkserver" in mp.get_all_start_methods() and not torch.cuda.is_available()
        method = "forkserver" if usable else "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs
    return ctx


def child_environment() -> dict[str, str]:
    """The parent's environment now, for `adopt_environment` in the rank."""
    return dict(os.environ)


def adopt_environment(env: dict[str, str]) -> None:
    """Take the parent's environment (a forked rank has the fork server's, from its start)."""
    os.environ.clear()
    os.environ.update(env)
# --8<-- [end:start-method]


# --8<-- [start:stack-dumps]
def enable_stack_dumps(stack_dir: str, rank: int) -> None:
    """On SIGUSR1, write every thread's Python stack to ``stack_dir/rank{rank}.txt``.

    The first line of the file names the main thread, so the parent can pick its stack.
    """
    f = open(os.path.join(stack_dir, f"rank{rank}.txt"), "w")  # noqa: SIM115 - lives as long as the process
    f.write(f"main thread 0x{threading.main_thread().ident:016x}\n")
    f.flush()
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
# --8<-- [end:stack-dumps]


def encode_result(rank: int, task_id: int, fn, args, kwargs) -> tuple:
    """Run `fn(*args, **kwargs)` and return the message to send to the parent."""
    try:
        value = fn(*args, **kwargs)
        return (task_id, rank, "ok", pickle.dumps(value))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        return encode_exception(rank, task_id, exc)


def encode_exception(rank: int, task_id: int, exc: BaseException) -> tuple:
    cls = type(exc)
    # pytest.skip raises _pytest.outcomes.Skipped (whose __module__ pytest sets to "builtins").
    is_skip = cls.__name__ == "Skipped" and any(c.__name__ == "OutcomeException" for c in cls.__mro__)
    status = "skip" if is_skip else "error"
    try:
        pickled = pickle.dumps(exc)
        pickle.loads(pickled)  # some exceptions pickle but cannot be rebuilt
    except Exception:  # noqa: BLE001
        pickled = None
    tb = "".join(traceback.format_exception(exc))
    info = (f"{cls.__module__}.{cls.__qualname__}".removeprefix("builtins."), str(exc), tb, pickled)
    return (task_id, rank, status, info)


# ---------------------------------------------------------------------------- parent side


def decode(rank: int, status: str, payload) -> Outcome:
    if status == "ok":
        try:
            return Outcome(rank, "ok", value=pickle.loads(payload))
        except Exception as exc:  # noqa: BLE001
            return Outcome(rank, "error", exc_type=type(exc).__name__,
                           message=f"its return value could not be unpickled: {exc}")
    exc_type, message, tb, pickled = payload
    exception = None
    if pickled is not None:
        try:
            exception = pickle.loads(pickled)
        except Exception:  # noqa: BLE001
            exception = None
    return Outcome(rank, status, exc_type=exc_type, message=message, remote_traceback=tb,
                   exception=exception)


def collect(
    results,
    procs,
    *,
    task_id: int,
    deadline: float,
    grace_s: float = 3.0,
) -> dict[int, Outcome]:
    """Wait for one outcome per rank, until `deadline` (time.monotonic()).

    `results` is a multiprocessing queue of (task_id, rank, status, payload) tuples;
    `procs` is the list of rank processes, index = rank. Returns every rank's outcome: ranks
    that exited without a word are "died", ranks still silent at the deadline (or after the
    grace period that follows another rank's failure) are "hung".
    """
    world_size = len(procs)
    outcomes: dict[int, Outcome] = {}
    stop_at = deadline
    while len(outcomes) < world_size:
        now = time.monotonic()
        if now >= stop_at:
            break
        try:
            msg_task, rank, status, payload = results.get(timeout=min(0.05, stop_at - now))
        except queue_mod.Empty:
            for rank, p in enumerate(procs):
                if rank not in outcomes and not p.is_alive():
                    # Its last message may still be in the pipe: give it a moment.
                    _drain(results, task_id, outcomes, wait_s=0.5)
                    if rank not in outcomes:
                        outcomes[rank] = Outcome(rank, "died", exitcode=p.exitcode)
        else:
            if msg_task == task_id and rank not in outcomes:
                outcomes[rank] = decode(rank, status, payload)
        if any(o.status not in ("ok", "skip") for o in outcomes.values()):
            stop_at = min(stop_at, time.monotonic() + grace_s)
    for rank in range(world_size):
        outcomes.setdefault(rank, Outcome(rank, "hung"))
    return outcomes


def _drain(results, task_id: int, outcomes: dict[int, Outcome], wait_s: float) -> None:
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            msg_task, rank, status, payload = results.get(timeout=0.05)
        except queue_mod.Empty:
            continue
        if msg_task == task_id and rank not in outcomes:
            outcomes[rank] = decode(rank, status, payload)


def dump_stacks(procs, outcomes: dict[int, Outcome], stack_dir: str) -> None:
    """Fill in `stack` for every hung rank by asking it (SIGUSR1) to dump its threads."""
    hung = [r for r, o in outcomes.items() if o.status == "hung" and procs[r].is_alive()]
    for r in hung:
        os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.3)
    for r in hung:
        try:
            with open(os.path.join(stack_dir, f"rank{r}.txt")) as f:
                outcomes[r].stack = main_thread_stack(f.read())
        except OSError:
            continue


def main_thread_stack(dump: str) -> str:
    """The main thread's block of a stack dump ("main thread ID" header, then faulthandler's
    blocks separated by blank lines); the whole dump when no block names that thread."""
    header, _, text = dump.partition("\n")
    main_id = header.removeprefix("main thread ")
    # Blank lines can leave empty blocks (a dump written twice, a trailing newline): skip them.
    blocks = [b.strip() for b in text.split("\n\n") if b.strip()]
    main = [b for b in blocks if main_id in b.splitlines()[0]]
    return (main[-1] if main else text).strip()


def kill_all(procs, grace_s: float = 1.0) -> None:
    """SIGTERM, then SIGKILL whatever is left after `grace_s`; reap everything."""
    procs = [p for p in procs if p.pid is not None]  # start() may have failed midway: skip the rest
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
