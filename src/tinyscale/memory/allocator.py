"""Best-fit blocks over one preallocated buffer: split on allocation, coalesce on free.

The idea behind DeepSpeed's contiguous memory allocator and PyTorch's caching allocator
(DS-24, OPT-9): ask the system for memory once, then hand out and take back pieces of it.
Sizes round up to `alignment`; a request takes the smallest free block that fits (best
fit), and the rest of that block stays free (split); a freed block merges with free
neighbours (coalesce), so freeing everything gives back one block. Fragmentation is
1 - largest free block / total free bytes: 0 when the free bytes are in one piece.
`defragment` compacts in place: every used block slides down, in address order, to the
lowest free offset (its bytes copied within the buffer), leaving one free block at the end;
it returns where each moved block went, for its owner to take a new view.

Tests: `pytest -k block_allocator`.
"""

from __future__ import annotations

import bisect

import torch


class OutOfMemory(MemoryError):
    """No free block is large enough, though the free bytes may add up to enough."""


class BlockAllocator:
    """Offsets into one byte buffer of `capacity` bytes; `view(offset)` gives the tensor."""

    def __init__(self, capacity: int, alignment: int = 512, *, buffer: bool = True) -> None:
        if capacity <= 0 or alignment <= 0:
            raise ValueError(f"capacity ({capacity}) and alignment ({alignment}) must be positive")
        self.capacity, self.alignment = capacity, alignment
        self.buffer = torch.empty(capacity, dtype=torch.uint8) if buffer else None
        self.free_blocks: list[tuple[int, int]] = [(0, capacity)]  # (offset, size), sorted by offset
        self.used: dict[int, int] = {}  # offset -> size
        self.peak = 0
        self.bytes_moved = 0  # by defragment, over the allocator's life

    def malloc(self, nbytes: int) -> int:
        """Offset of a block of at least `nbytes` (rounded up to the alignment)."""
        size = max(1, -(-nbytes // self.alignment)) * self.alignment
        fits = [(s, o) for o, s in self.free_blocks if s >= size]
        if not fits:
            raise OutOfMemory(f"no free block of {size:,} bytes: {self.free_bytes():,} bytes free in "
                              f"{len(self.free_blocks)} blocks, the largest {self.largest_free():,}")
        block_size, offset = min(fits)  # best fit: the smallest block that fits, lowest offset on ties
        i = bisect.bisect_left(self.free_blocks, (offset, block_size))
        if block_size - size >= self.alignment:  # split: the tail stays free
            self.free_blocks[i] = (offset + size, block_size - size)
        else:
            del self.free_blocks[i]
            size = block_size
        self.used[offset] = size
        self.peak = max(self.peak, self.allocated())
        return offset

    def free(self, offset: int) -> None:
        """Give a block back, merging it with a free block just before or after it."""
        if offset not in self.used:
            raise ValueError(f"offset {offset} is not an allocated block")
        size = self.used.pop(offset)
        i = bisect.bisect_left(self.free_blocks, (offset, 0))
        if i < len(self.free_blocks) and self.free_blocks[i][0] == offset + size:  # next is free
            size += self.free_blocks.pop(i)[1]
        if i > 0 and sum(self.free_blocks[i - 1]) == offset:  # previous is free
            offset, prev = self.free_blocks.pop(i - 1)
            size += prev
            i -= 1
        self.free_blocks.insert(i, (offset, size))

    # --8<-- [start:defragment]
    def defragment(self) -> dict[int, int]:
        """Slide every used block down to the lowest free offset, in address order; returns
        {old offset: new offset} of the blocks that moved (their owners must re-point)."""
        moved, at = {}, 0
        for offset in sorted(self.used):
            size = self.used[offset]
            if offset != at:  # always downwards: the block's old bytes are read before overwritten
                if self.buffer is not None:
                    self.buffer[at: at + size].copy_(self.buffer[offset: offset + size].clone())
                moved[offset] = at
                self.bytes_moved += size
            at += size
        self.used = {moved.get(o, o): s for o, s in self.used.items()}
        self.free_blocks = [(at, self.capacity - at)] if at < self.capacity else []
        return moved
    # --8<-- [end:defragment]

    def view(self, offset: int, nbytes: int | None = None) -> torch.Tensor:
        """The bytes of an allocated block, as a uint8 tensor sharing the buffer."""
        return self.buffer[offset: offset + (self.used[offset] if nbytes is None else nbytes)]

    def allocated(self) -> int:
        return sum(self.used.values())

    def free_bytes(self) -> int:
        return self.capacity - self.allocated()

    def largest_free(self) -> int:
        return max((s for _, s in self.free_blocks), default=0)

    def fragmentation(self) -> float:
        free = self.free_bytes()
        return 0.0 if free == 0 else 1.0 - self.largest_free() / free
