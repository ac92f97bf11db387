"""Expert parallelism for one MoE layer: all-to-all dispatch and combine equal one process.

Each rank routes its own tokens (capacity from its own count, as every layout does); the
single-process truth applies the same layer to each rank's tokens in turn. Outputs and the
gradients summed over ranks (each rank's expert gradient is nonzero only for its experts) must
agree to float64 rounding (rtol 1e-10: sums of a few hundred products, reordered; a token sent
to the wrong expert or combined into the wrong row is off by O(1e-2)). The ledger's all-to-all
bytes must equal those the routing counts imply, exactly.

Run: `pytest tests/moe/test_expert_parallel.py` (key expert_parallel).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tinyscale.dist import comm
from tinyscale.models import GPTConfig
from tinyscale.moe import MoE, all_to_all_bytes, apply_expert_parallel, expert_group_ranks
from tinyscale.dist.mesh import MeshLayout
from tinyscale.testing import run_on_ranks

TINY = GPTConfig.preset("tiny")


def _layer(E: int, k: int, cf) -> MoE:
    layer = MoE(TINY.with_(moe_experts=E, moe_top_k=k, moe_capacity_factor=cf), dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    return layer


def _tokens(rank: int) -> torch.Tensor:
    rows = 7 + 2 * rank  # uneven token counts on the ranks
    return torch.randn(1, rows, TINY.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + rank))


def _ep_body(E: int, k: int, cf):
    world, rank = dist.get_world_size(), dist.get_rank()
    layer = _layer(E, k, cf)
    apply_expert_parallel(layer, dist.group.WORLD)
    x = _tokens(rank).requires_grad_(True)
    with comm.record() as ledger:
        y = layer(x)
        (y.pow(2).sum() + layer.aux_loss).backward()
    counts = layer.experts.local
    sent = int(layer.stats.kept.sum())
    assert sent == int(layer.stats.load.sum()) - layer.stats.dropped
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)  # every rank's share: the sum over ranks of each rank's tokens' gradient
    return {"y": y.detach(), "dx": x.grad, "grads": grads, "bytes": ledger.bytes("all_to_all"),
            "calls": ledger.calls("all_to_all"), "sent": sent, "local": counts, "rows": ledger.rows,
            "kept": layer.stats.kept}


@pytest.mark.parametrize("world,E,k,cf", [(2, 6, 2, 0.8), (4, 4, 1, 0.9), (2, 4, 1, None)])
def test_expert_parallel_layer_equals_one_process_with_dropped_tokens(world, E, k, cf):
    out = run_on_ranks(_ep_body, world, E, k, cf)
    ref = _layer(E, k, cf)
    dropped = 0
    for rank in range(world):
        x = _tokens(rank).requires_grad_(True)
        y = ref(x)
        (y.pow(2).sum() + ref.aux_loss).backward()
        dropped += ref.stats.dropped
        torch.testing.assert_close(out[rank]["y"], y.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(out[rank]["dx"], x.grad, rtol=1e-10, atol=1e-12)
        assert out[rank]["local"] == (rank * E // world, (rank + 1) * E // world)
    assert (dropped > 0) == (cf is not None), "these capacities drop assignments"
    for name, p in ref.named_parameters():
        torch.testing.assert_close(out[0]["grads"][name], p.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_expert_parallel_all_to_all_bytes_equal_the_routing_counts():
    world, E = 4, 8
    out = run_on_ranks(_ep_body, world, E, 2, 0.75)
    for rank in range(world):
        o = out[rank]
        start, stop = o["local"]
        # rows this rank's experts receive: what every rank kept for them (each rank's routing counts)
        received = sum(int(other["kept"][start:stop].sum()) for other in out)
        want = all_to_all_bytes(E, o["sent"], received, TINY.d_model, 8)
        rows = [r for r in o["rows"] if r.op == "all_to_all"]
        # the forward's counts, rows out, rows back; the backward's rows out, rows back
        assert o["calls"] == 5 and [r.dtype for r in rows] == ["int64", "float64", "float64", "float64", "float64"]
        assert rows[0].bytes == want["counts"] and rows[1].bytes == o["sent"] * TINY.d_model * 8
        assert rows[2].bytes == received * TINY.d_model * 8
        assert o["bytes"] == sum(want.values())


def test_expert_parallel_groups_live_inside_dp():
    ep_groups, edp_groups = expert_group_ranks(MeshLayout(dp=4, tp=2), 2)
    assert ep_groups == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert edp_groups == [[0, 4], [2, 6], [1, 5], [3, 7]]
    with pytest.raises(ValueError, match="must divide dp"):
        expert_group_ranks(MeshLayout(dp=3), 2)
