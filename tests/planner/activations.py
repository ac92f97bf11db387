"""Measure a rank's peak of saved activation bytes over one engine step (for the planner's tests).

A pack hook (`saved_tensors_hooks`) sees every tensor autograd saves outside a checkpointed
region; each storage is counted once from when it is first saved until it is freed (a weakref
finalizer on the storage), parameters and buffers left out. The peak of that live sum over a
whole `train_batch` (every micro-batch in flight, as the schedule keeps them) is what the
planner's activation bytes predict.
"""

from __future__ import annotations

import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks


class SavedPeak:
    def __init__(self, model: torch.nn.Module) -> None:
        self.excluded = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        self.live = self.peak = 0
        self.tracked: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.tracked.discard(key)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.excluded and key not in self.tracked and storage.nbytes():
            self.tracked.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, storage.nbytes()).atexit = False
        # An alias without autograd history: `t` itself, when it is the output of the node saving
        # it (tanh, softmax), would make a cycle node -> t -> node that only a backward without
        # retain_graph breaks; zero-bubble's B keeps the graph and W never runs the nodes above the
        # weights' ones (pipeline/split_backward.py), so they would stay until the process ends.
        return t.detach()

    def __enter__(self):
        self._hooks = saved_tensors_hooks(self.pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
