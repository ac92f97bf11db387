"""The allocation trace of a real step, and its replay through `BlockAllocator`.

`record_trace(step)` runs `step()` under a dispatch mode that notes every new tensor
storage an op creates (("alloc", id, bytes)) and, through a weakref callback, when it dies
(("free", id)): the same events a caching allocator sees. `replay` feeds them to a
`BlockAllocator` and reports the peak and the worst fragmentation met on the way.

Tests: `pytest -k block_allocator`.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tinyscale.memory.allocator import BlockAllocator, OutOfMemory


class _Trace(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple] = []
        self.seen: set[int] = set()
        self.live: dict[int, int] = {}  # id -> data_ptr of the storages alive now
        self.ids = itertools.count()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in self.seen or ptr in inputs or storage.nbytes() == 0:
                continue
            self.seen.add(ptr)
            i = next(self.ids)
            self.events.append(("alloc", i, storage.nbytes()))
            self.live[i] = ptr
            weakref.finalize(storage, self._freed, i, ptr).atexit = False
        return out

    def _freed(self, i: int, ptr: int) -> None:
        self.seen.discard(ptr)
        self.live.pop(i, None)
        self.events.append(("free", i))


def record_trace(step: Callable[[], object]) -> list[tuple]:
    """("alloc", id, nbytes) and ("free", id) events of the storages step() creates."""
    mode = _Trace()
    with mode:
        step()
    return list(mode.events)


def replay(events: list[tuple], capacity: int, alignment: int = 512, *, defragment: bool = False) -> dict:
    """Run the trace through a BlockAllocator of `capacity` bytes (no buffer is allocated).
    defragment: when a request finds no block though the free bytes suffice, compact and retry."""
    alloc = BlockAllocator(capacity, alignment, buffer=False)
    where, sizes, live, peak_live, worst, oom, compactions = {}, {}, 0, 0, 0.0, None, 0
    for event in events:
        if event[0] == "alloc":
            _, i, nbytes = event
            worst = max(worst, alloc.fragmentation())
            try:
                where[i] = alloc.malloc(nbytes)
            except OutOfMemory as err:
                if not (defragment and alloc.free_bytes() >= max(1, -(-nbytes // alignment)) * alignment):
                    oom = str(err)
                    break
                moved = alloc.defragment()  # the owners re-point: here, the trace's offsets
                where = {k: moved.get(o, o) for k, o in where.items()}
                compactions += 1
                where[i] = alloc.malloc(nbytes)
            sizes[i] = nbytes
            live += nbytes
            peak_live = max(peak_live, live)
        elif event[1] in where:
            alloc.free(where.pop(event[1]))
            live -= sizes.pop(event[1])
    return {"peak_requested": peak_live, "peak_allocated": alloc.peak, "max_fragmentation": worst,
            "out_of_memory": oom, "compactions": compactions, "bytes_moved": alloc.bytes_moved}
