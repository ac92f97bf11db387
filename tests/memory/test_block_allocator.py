"""BlockAllocator (DS-24, OPT-9): best fit, splitting, coalescing, data kept, and the trace
of a real step replayed through it. Run: `pytest -k block_allocator`."""

from __future__ import annotations

import random

import pytest
import torch

from tinyscale.memory import BlockAllocator, OutOfMemory, record_trace, replay


def _check_invariants(a: BlockAllocator) -> None:
    blocks = sorted([(o, s, "used") for o, s in a.used.items()] + [(o, s, "free") for o, s in a.free_blocks])
    assert blocks[0][0] == 0 and sum(s for _, s, _ in blocks) == a.capacity  # they tile the buffer
    for (o1, s1, k1), (o2, _, k2) in zip(blocks, blocks[1:]):
        assert o1 + s1 == o2  # no overlap, no gap
        assert not (k1 == k2 == "free")  # two free neighbours would have been coalesced


def test_block_allocator_random_traffic_keeps_data_tiles_the_buffer_and_coalesces():
    a, rng, live = BlockAllocator(64 * 1024, alignment=64), random.Random(0), {}
    for step in range(400):
        if live and (rng.random() < 0.45 or len(live) > 40):
            offset = rng.choice(sorted(live))
            assert torch.equal(a.view(offset, live[offset].numel()), live.pop(offset))  # data kept
            a.free(offset)
        else:
            try:
                offset = a.malloc(rng.randint(1, 3000))
            except OutOfMemory:
                continue
            a.view(offset).fill_(step % 251)
            live[offset] = a.view(offset).clone()
        _check_invariants(a)
    for offset in list(live):
        a.free(offset)
    assert a.free_blocks == [(0, a.capacity)] and a.fragmentation() == 0.0  # all coalesced back


def test_block_allocator_takes_the_smallest_block_that_fits_and_splits_it():
    a = BlockAllocator(10 * 512, alignment=512, buffer=False)
    blocks = [a.malloc(512 * n) for n in (3, 1, 2, 1, 1)]  # offsets 0, 3, 4, 6, 7 (x512)
    a.free(blocks[0])  # a free hole of 3 blocks at 0
    a.free(blocks[2])  # a free hole of 2 blocks at 4 (and 2 blocks free at the end, 8-9)
    assert a.malloc(512) == 4 * 512  # best fit: a 2-block hole, the lowest of the two, split
    assert a.free_blocks == [(0, 3 * 512), (5 * 512, 512), (8 * 512, 2 * 512)]
    with pytest.raises(OutOfMemory, match="largest 1,536"):
        a.malloc(4 * 512)  # 6 blocks free in total, but no 4 in one piece: fragmentation
    assert a.fragmentation() == pytest.approx(1 - 3 / 6)


def test_block_allocator_replays_a_real_step_and_fragmentation_can_cost_a_fit():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)

    def step():
        model(x).square().mean().backward()

    events = record_trace(step)
    assert sum(e[0] == "alloc" for e in events) > 5 and any(e[0] == "free" for e in events)
    roomy = replay(events, capacity=1 << 30)
    assert roomy["out_of_memory"] is None and roomy["peak_allocated"] >= roomy["peak_requested"] > 0
    # one byte less than the rounded peak can never fit
    tight = replay(events, capacity=roomy["peak_allocated"] - 512)
    assert tight["out_of_memory"] is not None


def test_block_allocator_defragment_compacts_in_place_and_keeps_every_block_s_bytes():
    """A fragmenting trace: eight 1 KiB blocks, every other freed: 4 KiB free in four pieces,
    so 2 KiB does not fit; compaction slides the live blocks down and it does."""
    a = BlockAllocator(8 * 1024, alignment=512)
    blocks = [a.malloc(1024) for _ in range(8)]
    for k, offset in enumerate(blocks):
        a.view(offset).fill_(k)
    for offset in blocks[::2]:
        a.free(offset)
    assert a.free_bytes() == 4096 and a.fragmentation() == 0.75
    with pytest.raises(OutOfMemory):
        a.malloc(2048)
    moved = a.defragment()
    _check_invariants(a)
    assert a.fragmentation() == 0.0 and a.bytes_moved == 4 * 1024  # each of the four kept blocks moved
    assert sorted(moved.values()) == [0, 1024, 2048, 3072]
    for k, old in enumerate(blocks):
        if k % 2:  # the owner re-points at the new place: the bytes came along
            assert (a.view(moved.get(old, old)) == k).all()
    a.malloc(2048)


def test_block_allocator_replay_with_compaction_fits_a_real_step_at_its_peak():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)
    events = record_trace(lambda: model(x).square().mean().backward())
    peak = replay(events, capacity=1 << 30)["peak_allocated"]
    compacted = replay(events, capacity=peak, defragment=True)
    assert compacted["out_of_memory"] is None  # the live bytes never exceed the peak: compaction always finds room
    assert replay(events, capacity=peak - 512, defragment=True)["out_of_memory"] is not None
