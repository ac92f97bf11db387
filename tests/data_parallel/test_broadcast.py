"""The construction broadcast (`broadcast_parameters`, every data-parallel wrapper and ZeRO call it):
after it, every rank holds the group's first rank's parameters and buffers bit for bit, sent in
coalesced buckets (one broadcast per (group, dtype, device) bucket, as torch's DDP), with the
ledger counting the same bytes as one broadcast per tensor did.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tinyscale as ts
from tinyscale.data_parallel import base, broadcast_parameters
from tinyscale.dist import comm
from tinyscale.moe.parallel import ExpertShard
from tinyscale.testing import run_on_ranks


class Mixed(nn.Module):
    """Every kind of tensor the broadcast must carry, different on every rank (seeded by rank)."""

    def __init__(self, rank: int, expert_group):
        super().__init__()
        g = torch.Generator().manual_seed(1000 + rank)
        dev = ts.dist.device()

        def rand(*shape, dtype=torch.float64):  # float64 draws, rounded: bits no float32 holds
            return torch.randn(*shape, generator=g, dtype=torch.float64).to(dev, dtype)

        self.w64 = nn.Parameter(rand(5, 7))
        self.t64 = nn.Parameter(rand(7, 3).t())  # non-contiguous (a transpose), float64 between the others
        self.w32 = nn.Parameter(rand(11, dtype=torch.float32))
        self.wbf16 = nn.Parameter(rand(6, 4, dtype=torch.bfloat16))
        self.empty = nn.Parameter(rand(0, 3))
        self.frozen = nn.Parameter(rand(3, dtype=torch.float32), requires_grad=False)  # frozen: sent too
        self.tied = nn.Linear(4, 4, bias=False).to(dev, torch.float64)
        self.tied_again = nn.Linear(4, 4, bias=False)
        self.tied_again.weight = self.tied.weight  # one tensor under two names: parameters() lists it once
        self.expert = nn.Parameter(rand(2, 3))
        self.expert.expert_shard = ExpertShard(group=expert_group, mean_over=1, experts=(0, 1), num_experts=2)
        self.register_buffer("steps", torch.tensor([rank, 2**62 + rank, -rank], device=dev))  # int64 above 2**53
        self.register_buffer("flags", torch.tensor([rank % 2 == 0, True, False], device=dev))
        self.register_buffer("stats_bf16", rand(5, dtype=torch.bfloat16))
        self.register_buffer("strided", rand(4, 6)[:, ::2])  # non-contiguous (every other column)
        self.register_buffer("shared", self.steps)  # the same buffer twice: buffers() lists it once
        with torch.no_grad():  # values no arithmetic round trip keeps: -0.0, a NaN, an infinity
            self.w64[0, :3] = torch.tensor([-0.0, float("nan"), float("inf")])


def _bits(t: torch.Tensor) -> list[int]:
    """The tensor's elements as their raw bits (so -0.0 != 0.0 and a NaN equals itself)."""
    flat = t.detach().reshape(-1).contiguous().cpu()
    if flat.dtype == torch.bool:
        return flat.tolist()
    return flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]).tolist()


def _expert_groups(world_size: int):
    """The expert shards' groups: {0} and {1} on 2 ranks; {0} and {1, 2} on 3, whose source is rank 1."""
    ranks = [[0], [1]] if world_size == 2 else [[0], [1, 2]]
    group, _ = dist.new_subgroups_by_enumeration(ranks)
    return group


def _broadcast_mixed(cap_bytes: int | None):
    """On each rank: the Mixed model's tensors after the broadcast (bits, strides), and the ledger."""
    model = Mixed(dist.get_rank(), _expert_groups(dist.get_world_size()))
    before = {n: _bits(t) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    saved = base.BROADCAST_BUCKET_BYTES
    base.BROADCAST_BUCKET_BYTES = saved if cap_bytes is None else cap_bytes
    try:
        with comm.record() as ledger:
            broadcast_parameters(model)
    finally:
        base.BROADCAST_BUCKET_BYTES = saved
    after = {n: _bits(t) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    layout = {n: (t.shape, t.stride()) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    rows = [(r.op, r.bytes, r.dtype, r.ranks) for r in ledger.rows]
    return before, after, layout, rows, model.tied_again.weight is model.tied.weight


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_broadcast_parameters_copies_the_first_rank_bit_for_bit(world_size):
    results = run_on_ranks(_broadcast_mixed, world_size, None)
    before0 = results[0][0]
    for rank, (before, after, layout, _, still_tied) in enumerate(results):
        assert still_tied
        assert layout == results[0][2]  # shapes and strides untouched (the non-contiguous stay so)
        for name, bits in after.items():
            if name == "expert":  # an expert shard: its own group's first rank's (rank 1 for {1, 2})
                source = {0: 0, 1: 1, 2: 1}[rank]
                assert bits == results[source][0]["expert"], (rank, name)
            else:
                assert bits == before0[name], (rank, name)
        if rank > 0:  # the ranks did start different (so the broadcast is what made them equal)
            assert before["w64"] != before0["w64"] and before["steps"] != before0["steps"]


def _expected_rows(world_size: int) -> list[tuple]:
    """One broadcast per (group, dtype) in the order each first appears: parameters, then buffers."""
    everyone, expert = tuple(range(world_size)), lambda r: (r,) if r == 0 or world_size == 2 else (1, 2)
    f64 = 8 * (5 * 7 + 7 * 3 + 0 + 4 * 4)  # w64, t64, empty, tied (once), then (after the expert) strided
    return [[("broadcast", f64 + 8 * 4 * 3, "float64", everyone),
             ("broadcast", 4 * (11 + 3), "float32", everyone),
             ("broadcast", 2 * (6 * 4 + 5), "bfloat16", everyone),
             ("broadcast", 8 * 2 * 3, "float64", expert(r)),
             ("broadcast", 8 * 3, "int64", everyone),
             ("broadcast", 3, "bool", everyone)] for r in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_broadcast_parameters_sends_one_broadcast_per_group_and_dtype(world_size):
    results = run_on_ranks(_broadcast_mixed, world_size, None)
    assert [r[3] for r in results] == _expected_rows(world_size)
    # the same bytes as one broadcast per tensor: every parameter and buffer, each once
    per_tensor = sum(len(bits) * n for bits, n in [(results[0][1][k], _itemsize(k)) for k in results[0][1]])
    assert sum(row[1] for row in results[0][3]) == per_tensor


def _itemsize(name: str) -> int:
    return {"w32": 4, "frozen": 4, "wbf16": 2, "stats_bf16": 2, "flags": 1}.get(name, 8)


def test_ddp_broadcast_parameters_splits_a_group_and_dtype_at_the_bucket_cap():
    # w64 (8 * 35 = 280 bytes) alone in a 296-byte bucket: t64 (168) opens the next, empty (0) and tied
    # (128) fill it exactly to the cap (296: it stays one bucket), strided (96) opens a third
    rows = run_on_ranks(_broadcast_mixed, 2, 296)[0][3]
    assert [(op, n, dtype) for op, n, dtype, _ in rows if dtype == "float64" and n != 48] == [
        ("broadcast", 280, "float64"), ("broadcast", 296, "float64"), ("broadcast", 96, "float64")]
    rows = run_on_ranks(_broadcast_mixed, 2, 1)[0][3]  # a cap below every tensor: one per tensor
    assert len(rows) == 12  # one per tensor: 12 (the tied weight and the shared buffer once each)
