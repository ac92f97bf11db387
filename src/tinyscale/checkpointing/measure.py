"""Measure activation memory: bytes saved for backward, and the peak during a whole step.

    saved_bytes(model, idx, targets)          # bytes autograd keeps between forward and backward
    saved_tensors(block, x, cos, sin, exclude_state_of=model)   # ... one row per saved tensor
    peak_bytes(lambda: model(idx, targets).backward())          # peak of live tensor bytes

`saved_bytes` counts with `saved_tensors_hooks`: every tensor an autograd node saves passes
through our pack hook. Tensors sharing a storage (a view saved by three Linears, a tensor
and its transpose) are counted once, at the size of the whole storage, since the storage is
what stays allocated. **Parameters and buffers are not counted**: they are model state and
exist whether or not backward needs them; by default that is the state of `fn` when it is
an nn.Module, otherwise of `exclude_state_of`. Checkpointed or offloaded regions install
their own hooks, which take precedence over ours (only the innermost pair runs), so what
they recompute or move to the host is not counted: the count is what stays on the device.

`peak_bytes` is the high-water mark of tensor storage created while `step` runs
(activations, temporaries, recomputed tensors, gradients), followed with a dispatch mode
and weak references to each storage; it works on a CPU, where no allocator keeps stats.
Lesson: lessons/05-activation-checkpointing.md. Tests: `pytest -k activation_checkpoint`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass(frozen=True)
class SavedTensor:
    """One tensor saved for backward: who saved it, its shape, and its storage."""

    node: str  # the autograd node of the tensor (None for a leaf), e.g. "SoftmaxBackward0"
    shape: tuple[int, ...]
    dtype: torch.dtype
    storage_key: tuple[str, int]  # (device, address): equal for tensors sharing a storage
    storage_bytes: int


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


# --8<-- [start:saved-tensors]
def saved_tensors(fn: Callable, *args, exclude_state_of: nn.Module | None = None, **kwargs) -> list[SavedTensor]:
    """Run fn(*args, **kwargs) and list, in order, the tensors autograd saved for backward,
    leaving out the parameters and buffers of `exclude_state_of` (default: fn if a Module)."""
    state = exclude_state_of if exclude_state_of is not None else fn if isinstance(fn, nn.Module) else None
    excluded = set()
    if state is not None:
        excluded = {_storage_key(t) for t in (*state.parameters(), *state.buffers())}
    rows: list[SavedTensor] = []
    held: list[torch.Tensor] = []  # alive until counted, so no two storages share an address

    def pack(t: torch.Tensor) -> torch.Tensor:
        held.append(t)
        key = _storage_key(t)
        if key not in excluded:
            node = type(t.grad_fn).__name__ if t.grad_fn is not None else "leaf"
            rows.append(SavedTensor(node, tuple(t.shape), t.dtype, key, t.untyped_storage().nbytes()))
        return t  # saved as usual

    with saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    del out, held  # only now may the graph and the saved tensors go
    return rows


def saved_bytes(fn: Callable, *args, exclude_state_of: nn.Module | None = None, **kwargs) -> int:
    """Bytes of distinct storage autograd keeps from fn's forward for its backward."""
    rows = saved_tensors(fn, *args, exclude_state_of=exclude_state_of, **kwargs)
    return sum({row.storage_key: row.storage_bytes for row in rows}.values())
# --8<-- [end:saved-tensors]


class _LiveBytes(TorchDispatchMode):
    """Adds the storage of every tensor an op creates; a weakref callback subtracts it when
    the storage dies. Outputs sharing an input's storage (views, in-place ops) are not new."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.tracked: set[tuple[str, int]] = set()

    def _freed(self, key: tuple[str, int], nbytes: int) -> None:
        self.live -= nbytes
        self.tracked.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key, storage = _storage_key(t), t.untyped_storage()
            if key in self.tracked or key in inputs or storage.nbytes() == 0:
                continue
            self.tracked.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, storage.nbytes()).atexit = False
        return out


def peak_bytes(step: Callable[[], object]) -> int:
    """Peak bytes of tensor storage alive at once among those created while step() runs
    (model state and inputs made before are not counted; gradients made by it are)."""
    mode = _LiveBytes()
    with mode:
        step()
    return mode.peak
