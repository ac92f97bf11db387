"""Instrumented collectives: the one place tinyscale talks to `torch.distributed`.

Every collective and point-to-point message a topic issues goes through a function in
this module, so that a `Ledger` can see it: which op, how many bytes, over how many ranks,
and how long it took. Tests assert communication volume against theory from the ledger;
lessons print it beside the formula.

    with comm.record() as ledger:
        comm.all_reduce(grad)
    ledger.bytes("all_reduce"), ledger.calls("all_reduce"), ledger.rows

What `bytes` means for each op (the "size" of nccl-tests, so figures are comparable):

    all_reduce, broadcast, reduce   the tensor's size
    all_gather                      the gathered output's size (world_size x the input)
    reduce_scatter                  the input's size (world_size x the output)
    all_to_all                      the input's size
    send / isend                    the tensor's size (bytes this rank puts on the wire)
    recv / irecv                    the tensor's size (bytes this rank takes off the wire)

`Row.bus_bytes` converts that size into the bytes each rank sends under a
bandwidth-optimal (ring) algorithm, nccl-tests' "bus bandwidth" factor: all-reduce moves
2(n-1)/n of the size per rank, all-gather and reduce-scatter (n-1)/n. That is the figure
ZeRO's "2 Psi" and "3 Psi" are written in.

`Row.ranks` holds the global ranks the op ran over (its process group's, in group order; a
point-to-point op's pair, (sender, receiver)), so that a ledger's bytes can be split by mesh
axis (`tinyscale.engine.plan.traffic_by_axis`). It is filled only while a ledger records.

An async op (``async_op=True``) returns a `Work` whose ``wait()`` stamps the row with the
time the op completed, so the ledger also knows how long the op was in flight.

A watch (`watch`, opened by the engine around a step's forward and backward under tensor or
context parallelism) makes every wait on a watched gloo group poll a failure flag: a rank
that raised mid-forward never joins its peers' next collective, so a peer waiting in one
gives up (`poll` raises) instead of waiting until the deadline (`engine/step_failure.py`).

The module also hides the names torch keeps changing (``all_gather_into_tensor`` became
``all_gather_single`` in recent releases): topics never call those directly.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

# Newer torch renames the flat collectives and deprecates the old names; older torch has
# only the old ones. Pick once, here.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Per-rank bytes sent by a bandwidth-optimal algorithm, as a fraction of the op's size,
# for a group of n ranks (nccl-tests' busbw factors).
_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0 if n > 1 else 0.0,
    "reduce": lambda n: 1.0 if n > 1 else 0.0,
    "send": lambda n: 1.0,
    "isend": lambda n: 1.0,
    "recv": lambda n: 0.0,
    "irecv": lambda n: 0.0,
    "barrier": lambda n: 0.0,
}


@dataclass
class Row:
    """One communication call as this rank saw it."""

    op: str
    bytes: int
    group_size: int
    dtype: str
    seconds: float  # issue to completion; for async ops, filled in by Work.wait()
    async_op: bool = False
    peer: int | None = None  # global rank of the other side, for point-to-point ops
    start: float = 0.0  # time.perf_counter() at issue
    end: float | None = None  # time.perf_counter() at completion (None: async, not waited yet)
    ranks: tuple[int, ...] | None = None  # global ranks of the group (p2p: (sender, receiver))

    @property
    def bus_bytes(self) -> float:
        """Bytes this rank sends for this call under a ring (bandwidth-optimal) algorithm."""
        return self.bytes * _BUS_FACTOR[self.op](self.group_size)


@dataclass
class Ledger:
    """The rows recorded while a `record()` block was open (on this rank).

    ``max_rows=None`` (the default, what `record()` opens) keeps every row in the list `rows`.
    With `max_rows`, `rows` (a `collections.deque`) keeps the most recent `max_rows` rows, and
    a row pushed out of that window is folded into per-op running totals, so `bytes`,
    `bus_bytes`, `calls`, `seconds` and `by_op` still count every call recorded since the
    last `clear()`; what reads `rows` itself (a test's filter, `plan.traffic_by_axis`) sees
    the window only. The engine's ledger is bounded (`engine.COMM_LEDGER_MAX_ROWS`), so a long
    run does not keep a row for every call it ever made.
    """

    rows: list[Row] | deque[Row] = field(default_factory=list)
    max_rows: int | None = None
    # {op: {"calls", "bytes", "bus_bytes", "seconds"}} of the rows that left the window
    _retired: dict[str, dict[str, float]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        if self.max_rows is not None:
            if self.max_rows < 1:
                raise ValueError(f"Ledger.max_rows must be >= 1 (or None: keep every row), got {self.max_rows}")
            given, self.rows = self.rows, deque()
            for row in given:
                self.append(row)

    def append(self, row: Row) -> None:
        """Record one call: every op of this module adds its row to each open ledger through here."""
        if self.max_rows is not None and len(self.rows) == self.max_rows:
            # Folded as the row is now: an async row evicted before its Work.wait() counts with
            # seconds 0.0 (its later stamp is lost to the totals). The engine waits on every
            # async op within its step and its window holds many steps' rows, so there it cannot.
            old = self.rows.popleft()
            t = self._retired.setdefault(old.op, {"calls": 0, "bytes": 0, "bus_bytes": 0.0, "seconds": 0.0})
            t["calls"] += 1
            t["bytes"] += old.bytes
            t["bus_bytes"] += old.bus_bytes
            t["seconds"] += old.seconds
        self.rows.append(row)

    def _ops(self, op: str | Sequence[str] | None) -> set[str] | None:
        if op is None:
            return None
        ops = {op} if isinstance(op, str) else set(op)
        unknown = ops - _BUS_FACTOR.keys()
        if unknown:
            raise ValueError(f"unknown op {sorted(unknown)}; known ops: {sorted(_BUS_FACTOR)}")
        return ops

    def _select(self, op: str | Sequence[str] | None) -> Sequence[Row]:
        ops = self._ops(op)
        return self.rows if ops is None else [r for r in self.rows if r.op in ops]

    def _retired_total(self, op: str | Sequence[str] | None, key: str) -> float:
        ops = self._ops(op)
        return sum(t[key] for name, t in self._retired.items() if ops is None or name in ops)

    def bytes(self, op: str | Sequence[str] | None = None) -> int:
        """Total size of the selected calls (see the module docstring for what size means per op)."""
        return sum((r.bytes for r in self._select(op)), self._retired_total(op, "bytes"))

    def bus_bytes(self, op: str | Sequence[str] | None = None) -> float:
        """Total bytes this rank sends for the selected calls under ring algorithms."""
        return sum((r.bus_bytes for r in self._select(op)), self._retired_total(op, "bus_bytes"))

    def calls(self, op: str | Sequence[str] | None = None) -> int:
        return len(self._select(op)) + self._retired_total(op, "calls")

    def seconds(self, op: str | Sequence[str] | None = None) -> float:
        return sum((r.seconds for r in self._select(op)), self._retired_total(op, "seconds"))

    def by_op(self) -> dict[str, dict[str, float]]:
        """{op: {"calls", "bytes", "bus_bytes", "seconds"}} in first-seen order."""
        out = {op: dict(t) for op, t in self._retired.items()}
        for r in self.rows:
            s = out.setdefault(r.op, {"calls": 0, "bytes": 0, "bus_bytes": 0.0, "seconds": 0.0})
            s["calls"] += 1
            s["bytes"] += r.bytes
            s["bus_bytes"] += r.bus_bytes
            s["seconds"] += r.seconds
        return out

    def clear(self) -> None:
        self.rows.clear()
        self._retired.clear()


# The open ledgers of this process, innermost last. Every op appends to all of them, so an
# engine's own ledger and a test's ledger can watch the same calls.
_active: list[Ledger] = []


# --8<-- [start:record]
@contextlib.contextmanager
def record(ledger: Ledger | None = None) -> Iterator[Ledger]:
    """Collect a `Row` for every communication call made inside the block.

    Pass an existing ledger to keep appending to it (the engine does, across steps).
    """
    ledger = Ledger() if ledger is None else ledger
    _active.append(ledger)
    try:
        yield ledger
    finally:  # by identity: `list.remove` compares ledgers (dataclasses) by their rows, so a nested one
        # with the same rows as an enclosing one (both empty, say) would close the enclosing one
        del _active[max(i for i, open_ledger in enumerate(_active) if open_ledger is ledger)]
# --8<-- [end:record]


# --8<-- [start:watch]
@dataclass
class Watch:
    """Waits on `groups` (ids of gloo process groups) poll: every `interval` s of waiting,
    `poll(group)` runs, and raises if a peer in it failed (the op is then abandoned: `abandoned`)."""

    groups: frozenset[int]
    poll: Callable[[object], None]
    interval: datetime.timedelta = datetime.timedelta(milliseconds=50)
    abandoned: bool = False


_watches: list[Watch] = []


@contextlib.contextmanager
def watch(w: Watch) -> Iterator[Watch]:
    """Inside the block, ops on `w.groups` wait by polling (see the module docstring)."""
    _watches.append(w)
    try:
        yield w
    finally:
        _watches.remove(w)


def _watch_of(group) -> Watch | None:
    if not _watches:
        return None
    key = id(dist.group.WORLD if group is None else group)
    return next((w for w in reversed(_watches) if key in w.groups), None)


_P2P = frozenset({"send", "recv", "isend", "irecv"})


def _wait_watched(work, w: Watch, group, op: str) -> None:
    """`work.wait()`, giving up when `w.poll()` raises (the op is left pending: its group is
    out of step with its peers' from here on).

    A collective's wait takes a timeout and can be retried. A point-to-point op's cannot: a gloo
    send or recv whose `wait(timeout)` expires closes the connection to its peer, so the next
    message between them fails ("Connection closed by peer") even though nobody raised. Those
    wait, blocking, in a thread of their own while this one polls."""
    if op in _P2P:
        done, errors = threading.Event(), []

        def wait() -> None:
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                errors.append(exc)
            finally:
                done.set()

        threading.Thread(target=wait, name=f"tinyscale-{op}-wait", daemon=True).start()
        while not done.wait(w.interval.total_seconds()):
            _poll(w, group)
        if errors:
            raise errors[0]
        return
    while True:
        try:
            work.wait(timeout=w.interval)
            return
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():  # gloo: "Operation timed out!"
                raise
        _poll(w, group)


def _poll(w: Watch, group) -> None:
    try:
        w.poll(group)
    except BaseException:
        w.abandoned = True
        raise
# --8<-- [end:watch]


class Work:
    """Handle of an async op: ``wait()`` blocks until it is done and stamps its ledger row."""

    def __init__(self, work, row: Row | None, watched: Watch | None = None, group=None, op: str = ""):
        self._work = work
        self._op = op
        self._row = row
        self._watched = watched
        self._group = group

    def wait(self) -> None:
        if self._watched is not None:
            _wait_watched(self._work, self._watched, self._group, self._op)
        else:
            self._work.wait()
        if self._row is not None and self._row.end is None:
            self._row.end = time.perf_counter()
            self._row.seconds = self._row.end - self._row.start

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _group_size(group) -> int:
    return dist.get_world_size(group)


def _group_ranks(group, op: str, peer: int | None) -> tuple[int, ...]:
    """The global ranks an op ran over: the group's, or a point-to-point op's (sender, receiver)."""
    if peer is not None:
        me = dist.get_rank()
        return (me, peer) if op in ("send", "isend") else (peer, me)
    return tuple(dist.get_process_group_ranks(dist.group.WORLD if group is None else group))


def _issue(op: str, nbytes: int, tensor: torch.Tensor, group, async_op: bool, call, peer=None):
    """Run `call(async_op)` (the torch.distributed op) and record it in every open ledger; on a
    watched group a blocking op is issued async and waited for by polling."""
    watched = _watch_of(group)
    start = time.perf_counter()
    work = call(async_op or watched is not None)
    if watched is not None and not async_op:
        _wait_watched(work, watched, group, op)
    row = None
    if _active:
        end = None if async_op else time.perf_counter()
        row = Row(
            op=op,
            bytes=int(nbytes),
            group_size=_group_size(group),
            dtype=str(tensor.dtype).removeprefix("torch."),
            seconds=0.0 if end is None else end - start,
            async_op=async_op,
            peer=peer,
            start=start,
            end=end,
            ranks=_group_ranks(group, op, peer),
        )
        for ledger in _active:
            ledger.append(row)
    return Work(work, row, watched, group, op) if async_op else None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --8<-- [start:all_reduce]
def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """In place: every rank ends with the reduction of everyone's `tensor`."""
    call = lambda a: dist.all_reduce(tensor, op=op, group=group, async_op=a)  # noqa: E731
    return _issue("all_reduce", _nbytes(tensor), tensor, group, async_op, call)
# --8<-- [end:all_reduce]


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """In place on `dst` (a global rank): the reduction of everyone's `tensor`."""
    call = lambda a: dist.reduce(tensor, dst=dst, op=op, group=group, async_op=a)  # noqa: E731
    return _issue("reduce", _nbytes(tensor), tensor, group, async_op, call)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    """In place: every rank ends with `src`'s tensor (`src` is a global rank)."""
    call = lambda a: dist.broadcast(tensor, src=src, group=group, async_op=a)  # noqa: E731
    return _issue("broadcast", _nbytes(tensor), tensor, group, async_op, call)


# --8<-- [start:gloo-all-to-all]
# On gloo (CPU), the flat reduce-scatter and all-gather are built from all_to_all_single: torch's
# gloo reduce_scatter_tensor took 1.7x the time of an all_reduce of the same 3.5 MB buffer on 2
# ranks (4.3 ms against 2.5) and all_gather_into_tensor 1.4x (3.4 ms for half the bytes), where
# all_to_all moves the same bytes in 1.6 and 1.9 ms (4 ranks: 4.0 ms against 8.8 and 4.2 against
# 5.1; benchmarks/zero.py's lesson, lessons/03-zero.md). Reduce-scatter: every rank's i-th chunk
# goes to rank i, which sums the N chunks it receives (in rank order); all-gather: every rank
# sends its input to all, N copies in one all_to_all (or, with GLOO_ALL_GATHER_P2P, below, as
# point-to-point messages). Same bytes on the wire, ledger rows as before; a full-size receive
# buffer (reduce-scatter) or send buffer (all-gather, all-to-all only) while in flight. False:
# torch's own.
GLOO_VIA_ALL_TO_ALL = True


def _via_all_to_all(group, *tensors: torch.Tensor) -> bool:
    return (GLOO_VIA_ALL_TO_ALL and _group_size(group) > 1 and _watch_of(group) is None
            and dist.get_backend(group) == "gloo" and all(t.device.type == "cpu" for t in tensors))


class _Then:
    """An async op and the local step that completes it, run once by the first ``wait()``."""

    def __init__(self, work, then: Callable[[], object]):
        self._work, self._then = work, then

    def wait(self, *args) -> bool:
        if self._then is not None:
            self._work.wait(*args)
            then, self._then = self._then, None
            then()
        return True

    def is_completed(self) -> bool:
        return self._then is None or self._work.is_completed()


def _reduce_scatter_by_all_to_all(output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
    n = _group_size(group)
    received = torch.empty_like(input)  # row i: rank i's chunk of this rank's slice
    work = _Then(dist.all_to_all_single(received, input, group=group, async_op=True),
                 lambda: _sum_rows(received.view(n, -1), output.view(-1)))
    if async_op:
        return work
    work.wait()
    return None


def _sum_rows(rows: torch.Tensor, out: torch.Tensor) -> None:
    """out = the sum of rows' rows, in rank order. Two rows: one add (torch.sum over a dimension
    of 2 took about 3x as long: 0.12 and 0.16 ms of CPU against 0.044 and 0.047 for 2 x 295,552
    float32, two runs, 2026-11-27; the same sums)."""
    if rows.shape[0] == 2:
        torch.add(rows[0], rows[1], out=out)
    else:
        torch.sum(rows, dim=0, out=out)


def _all_gather_by_all_to_all(output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
    if GLOO_ALL_GATHER_P2P:
        return _all_gather_by_p2p(output, input, group, async_op)
    return dist.all_to_all_single(output.view(-1), input.reshape(-1).repeat(_group_size(group)), group=group,
                                  async_op=async_op)


# The all-gather as point-to-point messages instead: each rank's input goes to every other rank
# as it is, received straight into its row of `output`, and copied into its own row: no send
# buffer of N copies. 2 gloo ranks, 3.5 MB (2026-11-27, 120 interleaved calls, load 2.6): 2.07 ms
# against the all-to-all's 3.15 and all_gather_into_tensor's 3.24. Its own tag keeps it apart
# from a caller's send/recv on the group; gloo matches messages of one tag between two ranks in
# the order they were posted, as every rank posts its all-gathers in the same order.
GLOO_ALL_GATHER_P2P = True
_ALL_GATHER_TAG = 0x7A6700


class _AllWorks:
    """Several async ops as one handle; holds `keep` (the tensors sent) until they are done."""

    def __init__(self, works, keep=()):
        self._works, self._keep = works, keep

    def wait(self, *args) -> bool:
        for work in self._works:
            work.wait(*args)
        self._works, self._keep = [], ()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def _all_gather_by_p2p(output: torch.Tensor, input: torch.Tensor, group, async_op: bool):
    n, me, flat = _group_size(group), dist.get_rank(group), input.reshape(-1)
    rows = output.view(n, flat.numel())
    peers = [k for k in range(n) if k != me]
    works = [dist.irecv(rows[k], group=group, group_src=k, tag=_ALL_GATHER_TAG) for k in peers]
    works += [dist.isend(flat, group=group, group_dst=k, tag=_ALL_GATHER_TAG) for k in peers]
    rows[me].copy_(flat)
    work = _AllWorks(works, keep=(flat,))
    if async_op:
        return work
    work.wait()
    return None
# --8<-- [end:gloo-all-to-all]


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """`output` (world_size * input.numel() elements) gets every rank's `input`, in rank order."""
    n = _group_size(group)
    if output.numel() != n * input.numel():
        raise ValueError(
            f"all_gather: output has {output.numel()} elements but needs group size {n} x "
            f"input's {input.numel()} = {n * input.numel()}"
        )
    if _via_all_to_all(group, output, input) and output.is_contiguous():
        call = lambda a: _all_gather_by_all_to_all(output, input, group, a)  # noqa: E731
        return _issue("all_gather", _nbytes(output), input, group, async_op, call)
    call = lambda a: _all_gather_flat(output, input, group=group, async_op=a)  # noqa: E731
    return _issue("all_gather", _nbytes(output), input, group, async_op, call)


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False
):
    """`output` gets this rank's 1/world_size slice of the reduction of everyone's `input`."""
    n = _group_size(group)
    if input.numel() != n * output.numel():
        raise ValueError(
            f"reduce_scatter: input has {input.numel()} elements but needs group size {n} x "
            f"output's {output.numel()} = {n * output.numel()}"
        )
    if op == ReduceOp.SUM and _via_all_to_all(group, output, input) and input.is_contiguous() \
            and output.is_contiguous():
        call = lambda a: _reduce_scatter_by_all_to_all(output, input, group, a)  # noqa: E731
    else:
        call = lambda a: _reduce_scatter_flat(output, input, op=op, group=group, async_op=a)  # noqa: E731
    return _issue("reduce_scatter", _nbytes(input), input, group, async_op, call)


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group=None,
    async_op: bool = False,
):
    """Rank i's j-th chunk of `input` lands as rank j's i-th chunk of `output` (dim 0 splits)."""
    call = lambda a: dist.all_to_all_single(  # noqa: E731
        output, input, output_split_sizes, input_split_sizes, group=group, async_op=a
    )
    return _issue("all_to_all", _nbytes(input), input, group, async_op, call)


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    """Blocking send to global rank `dst`."""
    call = lambda a: dist.isend(tensor, dst, group) if a else dist.send(tensor, dst, group)  # noqa: E731
    _issue("send", _nbytes(tensor), tensor, group, False, call, dst)


def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    """Blocking receive from global rank `src` into `tensor`."""
    call = lambda a: dist.irecv(tensor, src, group) if a else dist.recv(tensor, src, group)  # noqa: E731
    _issue("recv", _nbytes(tensor), tensor, group, False, call, src)


def isend(tensor: torch.Tensor, dst: int, group=None) -> Work:
    call = lambda a: dist.isend(tensor, dst, group)  # noqa: E731
    return _issue("isend", _nbytes(tensor), tensor, group, True, call, dst)


def irecv(tensor: torch.Tensor, src: int, group=None) -> Work:
    call = lambda a: dist.irecv(tensor, src, group)  # noqa: E731
    return _issue("irecv", _nbytes(tensor), tensor, group, True, call, src)


@dataclass(frozen=True)
class P2POp:
    """One send or receive of a batch for `batch_isend_irecv` (`peer` is a global rank)."""

    op: str  # "isend" or "irecv"
    tensor: torch.Tensor
    peer: int
    group: object = None

    def __post_init__(self):
        if self.op not in ("isend", "irecv"):
            raise ValueError(f"P2POp.op must be 'isend' or 'irecv', got {self.op!r}")


def batch_isend_irecv(ops: Sequence[P2POp]) -> list[Work]:
    """Issue several sends/receives together (NCCL fuses them; avoids send/recv ordering deadlocks)."""
    if not ops:
        return []
    torch_ops = [
        dist.P2POp(dist.isend if p.op == "isend" else dist.irecv, p.tensor, p.peer, p.group)
        for p in ops
    ]
    start = time.perf_counter()
    works = dist.batch_isend_irecv(torch_ops)
    rows: list[Row | None] = []
    for p in ops:
        row = None
        if _active:
            row = Row(p.op, _nbytes(p.tensor), _group_size(p.group), str(p.tensor.dtype).removeprefix("torch."),
                      0.0, True, p.peer, start, None, _group_ranks(p.group, p.op, p.peer))
            for ledger in _active:
                ledger.append(row)
        rows.append(row)
    # torch returns one Work per op on gloo, and a single coalesced Work on NCCL.
    watched = [_watch_of(p.group) for p in ops]
    if len(works) == len(ops):
        return [Work(w, r, v, p.group, p.op) for w, r, v, p in zip(works, rows, watched, ops)]
    return [Work(works[0], r, v, p.group, p.op) for r, v, p in zip(rows, watched, ops)] if works else []


def barrier(group=None) -> None:
    """Wait for every rank of the group (recorded with 0 bytes)."""
    _issue("barrier", 0, torch.empty(0), group, False, lambda a: dist.barrier(group=group, async_op=a))
