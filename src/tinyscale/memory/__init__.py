"""A caching allocator over one preallocated buffer, and the allocation trace of a real step.

DS-24 / OPT-9 (issue 18, section 3): best-fit blocks, splitting and coalescing, with
fragmentation measured by replaying the storages a training step creates and frees.

    from tinyscale.memory import BlockAllocator, record_trace, replay

DS-25: `memory_timeline` (timeline.py), a step's live bytes by category (parameters,
optimizer states, gradients, activations, temporaries), on the CPU too.

Tests: `pytest -k block_allocator`, `pytest -k memory_timeline`. Demonstration: `python -m tinyscale.memory`.
"""

from tinyscale.memory.allocator import BlockAllocator, OutOfMemory
from tinyscale.memory.timeline import memory_timeline
from tinyscale.memory.trace import record_trace, replay

__all__ = ["BlockAllocator", "OutOfMemory", "memory_timeline", "record_trace", "replay"]
