"""A memory timeline of one training step on any device, the CPU included, by category.

`memory_timeline(model, optimizer, forward)` runs forward (returning the loss), backward and
the optimizer step under `record_trace`'s dispatch mode, and sorts every storage the step
creates into what it turned out to be:

    activations     saved for backward during the forward (autograd's saved-tensor hooks)
    gradients       a parameter's .grad after the backward
    optimizer       a tensor in the optimizer's state after the step
    temporaries     everything else (intermediate results freed within an op or a phase)

plus the parameters, present throughout (and the states and gradients that exist before the
step, which a steady-state step keeps). `rows` is the live bytes of each category after every
allocation and free, with the phase it happened in; `peaks` is each category's largest.
torch.cuda.memory's snapshot does this on a GPU from the allocator's own records; this works
from the storages themselves, so it needs no GPU. Test: `pytest -k memory_timeline`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tinyscale.memory.trace import _Trace

CATEGORIES = ("parameters", "optimizer", "gradients", "activations", "temporaries")


@dataclass
class Timeline:
    rows: list[tuple[str, dict[str, int]]] = field(default_factory=list)  # (phase, bytes per category)

    @property
    def peaks(self) -> dict[str, int]:
        return {c: max(r[c] for _, r in self.rows) for c in CATEGORIES}

    def at_end_of(self, phase: str) -> dict[str, int]:
        return [r for p, r in self.rows if p == phase][-1]


def _ptrs(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


def _bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors if isinstance(t, torch.Tensor))


def memory_timeline(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    forward: Callable[[], torch.Tensor]) -> Timeline:
    """One step (forward, backward, optimizer.step, zero_grad) and its memory by category."""
    params = [p for p in model.parameters()]
    states_before = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    base = {"parameters": _bytes(params), "optimizer": _bytes(states_before),
            "gradients": _bytes(p.grad for p in params if p.grad is not None)}
    mode, phases, saved_ptrs, owner = _Trace(), [], set(), {}

    def mark(phase: str) -> None:
        phases.append((len(mode.events), phase))

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved_ptrs.add(t.untyped_storage().data_ptr())
        return t
    with mode:
        mark("forward")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = forward()
        saved_at_forward = _live_ids(mode, saved_ptrs)
        mark("backward")
        loss.backward()
        grads = _live_ids(mode, _ptrs(p.grad for p in params))
        mark("optimizer")
        optimizer.step()
        states = _live_ids(mode, _ptrs(t for s in optimizer.state.values() for t in s.values()))
        mark("zero_grad")
        optimizer.zero_grad(set_to_none=True)
        del loss
    for ids, category in ((saved_at_forward, "activations"), (grads, "gradients"), (states, "optimizer")):
        owner.update(dict.fromkeys(ids, category))
    timeline, live, sizes = Timeline(), dict(base, activations=0, temporaries=0), {}
    starts = dict(phases)
    phase = "forward"
    for k, event in enumerate(mode.events):
        phase = starts.get(k, phase)
        if event[0] == "alloc":
            _, i, nbytes = event
            sizes[i] = (owner.get(i, "temporaries"), nbytes)
            live[sizes[i][0]] += nbytes
        elif event[1] in sizes:
            category, nbytes = sizes.pop(event[1])
            live[category] -= nbytes
        timeline.rows.append((phase, dict(live)))
    return timeline


def _live_ids(mode: _Trace, ptrs: set[int]) -> set[int]:
    """The trace ids of the live storages at `ptrs` (created during the traced step)."""
    return {i for i, ptr in mode.live.items() if ptr in ptrs}
