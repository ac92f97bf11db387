"""A step profiler: forward, backward, optimizer and communication (exposed vs hidden) per step.

With a plain training loop, mark the phases yourself:

    prof = StepProfiler()
    for x, y in batches:
        with prof.step(tokens=x.numel()):
            with prof.phase("forward"):
                loss = model(x, y)
            with prof.phase("backward"):
                loss.backward()
            with prof.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
    print_table(prof.records)                      # report.py: mean ms and % of the step
    save_chrome_trace(prof.records, "trace.json")  # open in chrome://tracing or ui.perfetto.dev

or let hooks mark them (`prof.attach(model, optimizer)`, then only `with prof.step():`):
forward from the model's forward hooks, backward from a hook on the model's output to the
end of autograd's pass, optimizer from `Optimizer.step`'s hooks. Hooks see what the model
and the optimizer do; anything else in the step (a loss computed outside the model,
`zero_grad`, logging) is "other".

Communication comes from the comm ledger (`tinyscale.dist.comm`): `step()` records every
collective issued inside it, and notes when the host starts waiting on an async op, so the
step splits into exposed and hidden communication (definitions: timeline.py). Each phase is
also a `torch.profiler.record_function` range, so a torch.profiler trace taken around the
loop shows the phases above the operators (`torch_trace`).

On CUDA, phases are timed with a `torch.cuda.synchronize()` at each boundary (kernels are
asynchronous: without it a phase measures only its kernel launches) and memory is sampled at
each boundary (allocated, reserved, and the step's peak): a memory timeline. A CPU has no such
counters in torch, so `memory` is None there. Lesson: lessons/06-mfu.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator

import torch

from tinyscale.dist import comm
from tinyscale.mfu.timeline import PHASES, Span, StepBreakdown, breakdown


@dataclasses.dataclass(frozen=True)
class CommSpan:
    """One ledger row as the timeline needs it (perf_counter seconds)."""

    op: str
    bytes: int
    start: float
    end: float  # completion as the host saw it; the step's end if never waited inside the step
    blocked_from: float | None  # when the host began waiting: start (synchronous) or wait() entry


@dataclasses.dataclass(frozen=True)
class MemorySample:
    time: float
    label: str  # "step start", "forward end", ...
    allocated: int
    reserved: int


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """Everything recorded for one step on this rank."""

    index: int
    start: float
    end: float
    tokens: int | None
    phases: dict[str, list[Span]]
    comm: list[CommSpan]
    breakdown: StepBreakdown
    memory: list[MemorySample] | None  # CUDA only
    peak_memory: int | None  # CUDA only: max_memory_allocated during the step


@contextlib.contextmanager
def _stamp_wait_starts() -> Iterator[None]:
    """While open, `comm.Work.wait()` notes on its ledger row when the host began waiting.

    The ledger stamps an async op's completion but not the start of the wait, which is what
    separates hidden from exposed time. Scoped to the step and restored in `finally`."""
    original = comm.Work.wait

    def wait(work: comm.Work) -> None:
        row = work._row
        if row is not None and row.end is None and getattr(row, "wait_start", None) is None:
            row.wait_start = time.perf_counter()
        original(work)

    comm.Work.wait = wait
    try:
        yield
    finally:
        comm.Work.wait = original


class StepProfiler:
    """Records steps (see the module docstring); `enabled=False` makes every call a no-op."""

    def __init__(self, *, enabled: bool = True, device: str | torch.device | None = None,
                 record_functions: bool = True) -> None:
        self.enabled = enabled
        self.device = torch.device(device) if device is not None else None
        self.record_functions = record_functions
        self.records: list[StepRecord] = []
        self._step: dict | None = None  # the open step's raw data
        self._open_phase: tuple[str, float, contextlib.ExitStack, bool] | None = None  # name, start, ranges, by hook

    # -- clocks ---------------------------------------------------------------------------------
    def _cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def _now(self, label: str) -> float:
        if self._cuda():
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if self._cuda() and self._step is not None:
            self._step["memory"].append(MemorySample(now, label, torch.cuda.memory_allocated(self.device),
                                                     torch.cuda.memory_reserved(self.device)))
        return now

    # -- steps ----------------------------------------------------------------------------------
    # --8<-- [start:step]
    @contextlib.contextmanager
    def step(self, tokens: int | None = None) -> Iterator[None]:
        """Profile the training step run inside the block (one optimizer step)."""
        if not self.enabled:
            yield
            return
        if self._step is not None:
            raise RuntimeError("StepProfiler.step() is already open: steps do not nest")
        if self._cuda():
            torch.cuda.reset_peak_memory_stats(self.device)
        self._step = {"phases": {name: [] for name in PHASES}, "memory": []}
        ledger = comm.Ledger()
        try:
            with comm.record(ledger), _stamp_wait_starts():
                start = self._now("step start")
                yield
                if self._open_phase is not None:
                    raise RuntimeError(f"phase {self._open_phase[0]!r} is still open at the end of the step")
                end = self._now("step end")
        finally:
            raw, self._step = self._step, None
            if self._open_phase is not None:  # the step raised inside a phase: drop the phase
                self._open_phase[2].close()
                self._open_phase = None
        spans = [CommSpan(r.op, r.bytes, r.start, r.end if r.end is not None else end,
                          r.start if not r.async_op else getattr(r, "wait_start", None)) for r in ledger.rows]
        blocked = [(c.blocked_from, c.end) for c in spans if c.blocked_from is not None]
        parts = breakdown((start, end), raw["phases"], [(c.start, c.end) for c in spans], blocked)
        self.records.append(StepRecord(
            index=len(self.records), start=start, end=end, tokens=tokens, phases=raw["phases"], comm=spans,
            breakdown=parts, memory=raw["memory"] if self._cuda() else None,
            peak_memory=torch.cuda.max_memory_allocated(self.device) if self._cuda() else None))
    # --8<-- [end:step]

    # -- phases ---------------------------------------------------------------------------------
    def _begin(self, name: str, by_hook: bool = False) -> None:
        if name not in PHASES:
            raise ValueError(f"phase {name!r} is unknown: use one of {', '.join(PHASES)}")
        if self._step is None:
            raise RuntimeError(f"phase({name!r}) outside a step: open `with profiler.step():` first")
        if self._open_phase is not None:
            raise RuntimeError(f"phase {name!r} opened inside phase {self._open_phase[0]!r}: phases do not nest")
        # The clock reads outside the record_function range, so the phase includes the range's
        # own cost (its first use takes a millisecond or more): a phase is its whole block.
        start = self._now(f"{name} start")
        stack = contextlib.ExitStack()
        if self.record_functions:
            stack.enter_context(torch.profiler.record_function(f"tinyscale/{name}"))
        self._open_phase = (name, start, stack, by_hook)

    def _end(self, name: str) -> None:
        opened, start, stack, _ = self._open_phase
        assert opened == name, (opened, name)
        self._open_phase = None
        stack.close()
        self._step["phases"][name].append((start, self._now(f"{name} end")))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as `name` ("forward", "backward" or "optimizer") of the open step."""
        if not self.enabled:
            yield
            return
        self._begin(name)
        try:
            yield
        finally:
            self._end(name)

    # -- hooks ----------------------------------------------------------------------------------
    # --8<-- [start:attach]
    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list:
        """Mark phases from hooks instead of `phase()` blocks; returns handles (call .remove()).

        A hook does nothing outside a step or while another phase is open (explicit phases win)."""
        def idle() -> bool:
            return not self.enabled or self._step is None or self._open_phase is not None

        def begin(name: str) -> None:
            if not idle():
                self._begin(name, by_hook=True)

        def end(name: str) -> bool:  # closes only a phase a hook opened, never a phase() block
            if self._open_phase is not None and self._open_phase[0] == name and self._open_phase[3]:
                self._end(name)
                return True
            return False

        def forward_pre(module, args) -> None:
            begin("forward")

        def forward_post(module, args, output) -> None:
            if end("forward") and isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(backward_start)

        def backward_start(grad: torch.Tensor) -> None:
            # Runs as autograd reaches the model's output, i.e. as backward starts; the queued
            # callback runs when autograd's whole pass is done.
            if not idle():
                begin("backward")
                torch.autograd.Variable._execution_engine.queue_callback(lambda: end("backward"))

        def optimizer_pre(opt, args, kwargs) -> None:
            begin("optimizer")

        def optimizer_post(opt, args, kwargs) -> None:
            end("optimizer")

        handles = [model.register_forward_pre_hook(forward_pre), model.register_forward_hook(forward_post)]
        if optimizer is not None:
            handles += [optimizer.register_step_pre_hook(optimizer_pre),
                        optimizer.register_step_post_hook(optimizer_post)]
        return handles
    # --8<-- [end:attach]
