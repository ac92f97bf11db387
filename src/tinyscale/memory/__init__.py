"""A caching allocator over one preallocated buffer, and the allocation trace of a real step.

DS-24 / OPT-9 (issue 18, section 3): best-fit blocks, splitting and coalescing, with
fragmentation measured by replaying the storages a training step creates and frees.

    from tinyscale.memory import BlockAllocator, record_trace, replay

Tests: `pytest -k block_allocator`. Demonstration: `python -m tinyscale.memory`.
"""

from tinyscale.memory.allocator import BlockAllocator, OutOfMemory
from tinyscale.memory.trace import record_trace, replay

__all__ = ["BlockAllocator", "OutOfMemory", "record_trace", "replay"]
