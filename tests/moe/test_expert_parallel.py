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
    rank = dist.get_rank()
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


def _kept_bytes(layer: MoE, x: torch.Tensor) -> int:
    """Bytes autograd keeps for one forward of `layer`: each saved tensor's storage once, the input's
    and the parameters' left out (the caller holds those anyway)."""
    seen = {t.untyped_storage().data_ptr(): 0 for t in (x, *layer.parameters())}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(seen.values())


def _kept_body(E: int, k: int, cf):
    layer = _layer(E, k, cf)
    x = _tokens(dist.get_rank()).requires_grad_(True)
    one = _kept_bytes(layer, x)
    apply_expert_parallel(layer, dist.group.WORLD)
    two = _kept_bytes(layer, x)
    return one, two, layer.stats.kept, layer.experts.local


def test_expert_parallel_keeps_what_one_process_keeps_plus_the_sort():
    """Same tokens, same routing, at ep 1 and ep 2. What differs: the experts compute R received rows
    instead of the M kept assignments, and each expert row keeps its input (C) and its SwiGLU's
    insides (4 F_e: the gate's output, its silu, the up projection, their product); the exchange
    keeps only the sort of the received rows by expert, R int64 (dispatch's gather and combine's
    scatter share it; the all-to-alls keep nothing). So ep 2 - ep 1 = 8 ((R - M)(C + 4 F_e) + R)
    bytes in float64, exactly (combine's index_copy, which kept its source too, R C more, fails this)."""
    out = run_on_ranks(_kept_body, 2, 4, 2, None)
    C, Fe = TINY.d_model, TINY.expert_dim
    for one, two, kept, (start, stop) in out:
        M = int(kept.sum())
        R = sum(int(other[2][start:stop].sum()) for other in out)  # every rank's rows for my experts
        assert M != R, "the ranks receive other row counts than they send (uneven tokens and routing)"
        assert two - one == 8 * ((R - M) * (C + 4 * Fe) + R)


def test_expert_parallel_groups_live_inside_dp():
    ep_groups, edp_groups = expert_group_ranks(MeshLayout(dp=4, tp=2), 2)
    assert ep_groups == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert edp_groups == [[0, 4], [2, 6], [1, 5], [3, 7]]
    with pytest.raises(ValueError, match="must divide dp"):
        expert_group_ranks(MeshLayout(dp=3), 2)


def _sharded_body(ep: int):
    """dp = world ranks, experts stored sharded over ep groups inside dp: one step's gradient."""
    from tinyscale.models import GPT
    from tinyscale.moe import expert_groups, reduce_expert_gradients, shard_experts
    world, rank = dist.get_world_size(), dist.get_rank()
    model = GPT(_GPT, seed=1, dtype=torch.float64)
    ep_group, edp_group = expert_groups(MeshLayout(dp=world), ep)
    apply_expert_parallel(model, ep_group)
    shard_experts(model)
    x, y = _gpt_batch()
    rows = x.shape[0] // world
    with comm.record() as ledger:
        model(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]).backward()
        expert = {n for n, _ in model.named_parameters() if ".experts." in n}
        for n, p in model.named_parameters():
            if n not in expert:
                comm.all_reduce(p.grad)
                p.grad.div_(world)
        reduce_expert_gradients(model, edp_group, world)
    edp = [r.bytes for r in ledger.rows if r.op == "all_reduce" and r.group_size == world // ep]
    return {n: p.grad for n, p in model.named_parameters()}, {n: model.blocks[0].mlp.experts.first for n in expert}, edp


_GPT = GPTConfig(vocab_size=40, max_seq_len=8, n_layer=2, n_head=2, d_model=8, ffn_hidden=12, moe_experts=4,
                 moe_top_k=2, moe_capacity_factor=0.9)


def _gpt_batch():
    gen = torch.Generator().manual_seed(4)
    return torch.randint(0, 40, (4, 8), generator=gen), torch.randint(0, 40, (4, 8), generator=gen)


def test_expert_parallel_sharded_experts_reduce_over_the_expert_data_parallel_group():
    """dp 4 with ep 2: each rank stores 2 of the 4 experts; the expert shards' gradients summed over
    their expert-data-parallel pair / dp equal the single-process gradient of the batch's mean loss
    (each rank's rows are one micro-batch of the reference's four)."""
    from tinyscale.models import GPT
    out = run_on_ranks(_sharded_body, 4, 2)
    ref = GPT(_GPT, seed=1, dtype=torch.float64)
    x, y = _gpt_batch()
    for i in range(4):
        (ref(x[i:i + 1], y[i:i + 1]) / 4).backward()
    for rank, (grads, first, edp_bytes) in enumerate(out):
        assert first and set(first.values()) == {2 * (rank % 2)}
        for name, p in ref.named_parameters():
            want = p.grad
            if ".experts." in name:
                want = want[first[name]:first[name] + 2]  # this rank's shard
            torch.testing.assert_close(grads[name], want, rtol=1e-10, atol=1e-13, msg=name)
        # the expert-data-parallel all-reduce moves only the shard: 2 layers x 3 tensors x 2 experts
        assert sum(edp_bytes) == 2 * 2 * 3 * 8 * 12 * 8
