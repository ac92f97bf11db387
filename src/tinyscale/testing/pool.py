"""A persistent pool of rank processes per world size, for running test bodies on N ranks.

Spawning 4 ranks costs ~5 s (each imports torch and joins a process group), and the suite
runs hundreds of distributed bodies, so ranks are started once per world size and reused
(DeepSpeed's tests do the same). A body is any module-level function; it runs on every
rank with the same arguments and its per-rank return values come back in rank order:

    def body(n):                                  # runs on each rank
        t = torch.full((n,), float(dist.get_rank()))
        comm.all_reduce(t)
        return t
    run_on_ranks(body, 4, 3)                      # -> [tensor, tensor, tensor, tensor]

Failures behave like `tinyscale.dist.launch`: an exception names the rank and carries its
traceback, a hung rank is named (with its stack) after the run's timeout, and a
`pytest.skip` raised on every rank skips the test. After any failure the pool is torn down
and restarted on next use, because ranks that failed at different points may disagree
about which collective comes next.
"""

from __future__ import annotations

import atexit
import datetime
import os
import pickle
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from tinyscale.dist import comm, procs
from tinyscale.dist.launch import check_picklable, pg_timeout, raise_for_outcomes
from tinyscale.dist.runtime import init_rank

DEFAULT_TIMEOUT_S = float(os.environ.get("TINYSCALE_TEST_TIMEOUT", 90))
_HOST = "127.0.0.1"
_READY = -1  # task id of the "joined the process group" message


def _worker_main(rank, world_size, port, backend, timeout_s, tasks, results, parent_pid, stack_dir, env):
    procs.adopt_environment(env)
    procs.die_with_parent(parent_pid)
    procs.enable_stack_dumps(stack_dir, rank)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=_HOST, MASTER_PORT=str(port))
    try:
        store = dist.TCPStore(_HOST, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        init_rank(rank, world_size, local_rank=rank, local_world_size=world_size, backend=backend,
                  timeout_s=pg_timeout(timeout_s), store=store)
    except BaseException as exc:  # noqa: BLE001 - report, never die silently
        results.put(procs.encode_exception(rank, _READY, exc))
        return
    results.put((_READY, rank, "ok", pickle.dumps(None)))
    # --8<-- [start:worker-loop]
    while True:
        message = tasks.get()
        if message is None:
            break
        task_id, payload, sys_path = message
        for entry in sys_path:  # the parent may have learned new import roots (pytest rootdirs)
            if entry not in sys.path:
                sys.path.append(entry)
        _reset_process_state()
        try:
            fn, args, kwargs = pickle.loads(payload)
        except BaseException as exc:  # noqa: BLE001
            results.put(procs.encode_exception(rank, task_id, exc))
            continue
        results.put(procs.encode_result(rank, task_id, fn, args, kwargs))
    # --8<-- [end:worker-loop]
    dist.destroy_process_group()


def _reset_process_state() -> None:
    """What one test body may leave behind that would change the next one."""
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    comm._active.clear()


class RankPool:
    """`world_size` rank processes in one process group, reused across runs."""

    def __init__(self, world_size: int, *, backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"RankPool: world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self._procs: list = []
        self._task_id = 0
        self.starts = 0  # how many times the ranks were (re)started: tests of the pool read it

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _start(self) -> None:
        ctx = procs.start_context()
        self._store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=self.timeout_s))
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._stack_dir = tempfile.mkdtemp(prefix="tinyscale-pool-")
        self._procs = [
            ctx.Process(target=_worker_main, name=f"tinyscale-pool{self.world_size}-rank{r}",
                        args=(r, self.world_size, self._store.port, self.backend, self.timeout_s,
                              self._tasks[r], self._results, os.getpid(), self._stack_dir,
                              procs.child_environment()))
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self.starts += 1
        outcomes = procs.collect(self._results, self._procs, task_id=_READY,
                                 deadline=time.monotonic() + self.timeout_s)
        if not all(o.status == "ok" for o in outcomes.values()):
            procs.dump_stacks(self._procs, outcomes, self._stack_dir)
            self.close()
            raise_for_outcomes(outcomes, self.timeout_s)

    def run(self, fn: Callable, *args, timeout_s: float | None = None, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; per-rank results in rank order."""
        check_picklable(fn, (args, kwargs))
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if not self.alive:
            self.close()
            self._start()
        self._task_id += 1
        payload = pickle.dumps((fn, args, kwargs))
        deadline = time.monotonic() + timeout_s
        for q in self._tasks:
            q.put((self._task_id, payload, list(sys.path)))
        outcomes = procs.collect(self._results, self._procs, task_id=self._task_id, deadline=deadline)
        statuses = {o.status for o in outcomes.values()}
        if statuses not in ({"ok"}, {"skip"}):
            procs.dump_stacks(self._procs, outcomes, self._stack_dir)
            # A hung rank never reads the stop message: waiting for it to leave politely only
            # added close()'s 2 s to every hang (and every raise that left peers in a collective).
            self.close(polite="hung" not in statuses)
        return raise_for_outcomes(outcomes, timeout_s)

    def close(self, *, polite: bool = True) -> None:
        """Stop the ranks (politely, then not; at once with `polite=False`); the next `run` starts
        fresh ones."""
        if not self._procs:
            return
        for q in self._tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + (2.0 if polite else 0.0)
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        procs.kill_all(self._procs)
        for q in [*self._tasks, self._results]:
            q.close()
            q.cancel_join_thread()
        shutil.rmtree(self._stack_dir, ignore_errors=True)
        self._procs = []
        del self._store


_pools: dict[tuple[int, str], RankPool] = {}


def get_pool(world_size: int, backend: str = "auto") -> RankPool:
    """The process-wide pool for this world size (created on first use)."""
    key = (world_size, backend)
    if key not in _pools:
        _pools[key] = RankPool(world_size, backend=backend)
    return _pools[key]


def run_on_ranks(fn: Callable, world_size: int, *args, timeout_s: float | None = None,
                 backend: str = "auto", **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on `world_size` pooled ranks; results in rank order."""
    return get_pool(world_size, backend).run(fn, *args, timeout_s=timeout_s, **kwargs)


def close_pools() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()


atexit.register(close_pools)
