"""Counting the tensor operations a piece of code launches (a dispatch mode).

    with CountOps() as count:
        loss.backward()
    count.ops["aten.copy_.default"]     # how many copies that backward made

Tests use it to pin what a hook adds to a backward: the difference between two counted runs
(with and without the hook) cancels autograd's own operations.
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class CountOps(TorchDispatchMode):
    """`ops`: {operator name: calls} of every tensor operation dispatched inside the block."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))
