"""HFU's hardware FLOPs on a layout (`tinyscale.mfu.layout_flops`): what the ranks of a step run,
summed, equals FlopCounterMode's count exactly, under context parallelism (ring and Ulysses,
padded sequences, dropout, recomputation), tensor parallelism (the padded vocabulary rows) and
a fused attention kernel (its backward recomputes Q K^T); and the ring's blocks add up to the
hand formula of each sharding."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from tinyscale.context_parallel.sharding import Layout, plan_work
from tinyscale.mfu import forward_flops, layout_flops, model_flops_per_token
from tinyscale.models import GPTConfig

aten = torch.ops.aten


def _sdpa_forward(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q, k, v)


def _sdpa_backward(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, q, k, v)


# The CPU's fused attention kernel (SDPA's, and context_parallel/blocks.py's) has no formula in
# FlopCounterMode, which counts it 0; these are torch's own formulas for its GPU kernels (forward
# Q K^T and P V; backward Q K^T again, then dV, dP, dQ, dK), applied to the CPU kernel's shapes.
CPU_FLASH = {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_forward,
             aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward}


def test_mfu_hfu_context_parallel_ring_blocks_add_up_to_the_hand_formula():
    """Ring attention's blocks (`block_plan`), summed over the ranks: zigzag runs cp(2cp+1) of the
    (2cp)^2 chunk pairs (every pair not wholly in the future, each whole, the 2cp diagonal ones
    included), contiguous cp(cp+1)/2 of cp^2; counting only a diagonal block's triangle (causal=True) gives
    the causal mask's P(P+1)/2 pairs either way. Ulysses runs the whole P x P square per head."""
    cfg = GPTConfig(vocab_size=63, max_seq_len=64, n_layer=3, n_head=4, n_kv_head=2, d_model=16, ffn_hidden=24)
    per_pair = cfg.n_layer * 2 * cfg.d_model  # Q K^T FLOPs of one (query, key) pair over every head and layer
    for cp in (2, 3, 4):
        for T in (24, 23):  # 23: padded to P = 24 (a multiple of 2cp for cp 2, 3, 4 and of cp)
            P = 24
            zig, con = (layout_flops(cfg, T, cp=cp, cp_sharding=s) for s in ("zigzag", "contiguous"))
            L = P // (2 * cp)
            assert zig.scores == zig.values == per_pair * cp * (2 * cp + 1) * L * L
            L = P // cp
            assert con.scores == per_pair * cp * (cp + 1) // 2 * L * L
            for sharding in ("zigzag", "contiguous"):
                triangle = layout_flops(cfg, T, cp=cp, cp_sharding=sharding, causal=True)
                assert triangle.scores == per_pair * P * (P + 1) // 2
            uly = layout_flops(cfg, T, cp=cp, cp_algorithm="ulysses")
            assert uly.scores == per_pair * P * P and uly.backward_rerun == uly.scores
            # every other matmul runs on the P padded positions; the ring recomputes Q K^T in backward
            padded = forward_flops(cfg, P)
            assert (zig.qkvo, zig.mlp, zig.head) == (padded.qkvo, padded.mlp, padded.head)
            assert zig.backward_rerun == zig.scores and not zig.explicit_core
    # the closed form against the plan the ring runs (context_parallel.plan_work sums block_plan's
    # blocks, a diagonal one's triangle): causal=True is that sum, on lengths no chunk count divides
    for cp in (2, 3, 5):
        for sharding in ("zigzag", "contiguous"):
            for T in range(1, 40):
                plan = sum(plan_work(Layout(cp, sharding, T), r, causal=True) for r in range(cp))
                assert layout_flops(cfg, T, cp=cp, cp_sharding=sharding, causal=True).scores == per_pair * plan
    with pytest.raises(ValueError, match="cp_sharding"):
        layout_flops(cfg, 16, cp=2, cp_sharding="stripes")
    # MFU is the model's, whatever the layout
    assert model_flops_per_token(cfg, 23) == forward_flops(cfg, 23).model / 23


def test_mfu_hfu_tensor_parallel_counts_the_padded_vocabulary_rows():
    """Vocab 63 on tp 2 or 4: the head runs 64 rows (Megatron's padding); MFU keeps the model's 63."""
    cfg = GPTConfig(vocab_size=63, max_seq_len=16, n_layer=2, n_head=4, d_model=16, ffn_hidden=24)
    plain = forward_flops(cfg, 16)
    for tp in (2, 4):
        on_tp = layout_flops(cfg, 16, tp=tp)
        assert on_tp.head - plain.head == 2 * 16 * cfg.d_model * (64 - 63)
        assert on_tp.hardware() - plain.hardware() == 3 * (on_tp.head - plain.head)  # forward, dX and dW
    assert layout_flops(cfg, 16, tp=3) == plain  # 63 = 3 x 21: nothing padded
    with pytest.raises(ValueError, match="cp_algorithm"):
        layout_flops(cfg, 16, cp=2, cp_algorithm="stripes")
    with pytest.raises(ValueError, match="tp="):
        layout_flops(cfg, 16, tp=0)


def test_mfu_hfu_fused_attention_backward_recomputes_scores_and_selective_adds_its_rerun():
    """One process, SDPA's fused kernel (attn_impl "sdpa", no dropout): its backward recomputes
    Q K^T, and a selective checkpoint reruns the whole core besides (the kernel saves its
    output): FlopCounterMode with torch's SDPA formulas counts both."""
    from torch.utils.checkpoint import checkpoint

    from tinyscale.models import GPT

    cfg = GPTConfig(vocab_size=63, max_seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=16, ffn_hidden=24)
    f = forward_flops(cfg, 16)
    assert not f.explicit_core and f.backward_rerun == f.scores
    x = torch.randint(0, 63, (2, 16), generator=torch.Generator().manual_seed(0))
    for recompute in ("none", "selective"):
        model = GPT(cfg, seed=0, dtype=torch.float64)
        if recompute == "selective":
            for block in model.blocks:  # the core under torch's (non-re-entrant, early-stop) checkpoint
                block.attn.core = functools.partial(
                    lambda q, k, v, core: checkpoint(core, q, k, v, use_reentrant=False), core=block.attn.core)
        with FlopCounterMode(display=False, custom_mapping=CPU_FLASH) as counter:
            model(x, x).backward()
        assert counter.get_total_flops() == 2 * f.hardware(recompute)
    assert f.hardware("selective") - f.model == f.backward_rerun + f.attention  # Q K^T in backward; Q K^T, P V rerun


_ROWS, _SEQ = 2, 15  # 15 tokens: padded to 16 on cp 2 (one padded position each row)
_COUNTER = {"dropout": 0.1, "dropout_masks": "counter"}
# (GPTConfig options, config options): each engine step on 2 ranks
_CASES = {
    "cp2-ring-zigzag": ({}, {"parallel": {"context": 2}}),
    "cp2-ring-contiguous-selective": ({}, {"parallel": {"context": 2, "context_sharding": "contiguous"},
                                           "activation_checkpointing": {"policy": "selective"}}),
    "cp2-ring-counter-dropout-full": (_COUNTER, {"parallel": {"context": 2},
                                                 "activation_checkpointing": {"policy": "full"}}),
    "cp2-ulysses-selective": ({}, {"parallel": {"context": 2, "context_algorithm": "ulysses"},
                                   "activation_checkpointing": {"policy": "selective"}}),
    "cp2-ulysses-counter-dropout-selective": (_COUNTER, {"parallel": {"context": 2, "context_algorithm": "ulysses"},
                                                         "activation_checkpointing": {"policy": "selective"}}),
    "tp2-padded-vocab-selective": ({}, {"parallel": {"tensor": 2},
                                        "activation_checkpointing": {"policy": "selective"}}),
    "dp2-fused-core": ({}, {}),
    # stream dropout: the CPU's SDPA runs its math path (the fused kernel takes no dropout)
    "dp2-sdpa-stream-dropout-selective": ({"dropout": 0.1}, {"activation_checkpointing": {"policy": "selective"}}),
}


def _steps(names: list[str]) -> list[tuple[int, float, int]]:
    """Per case: this rank's FLOPs in one engine step (FlopCounterMode, the CPU's fused attention
    kernel counted by torch's SDPA formulas), the hardware FLOPs per token the engine's HFU counts,
    and the job's hardware FLOPs of a sequence (`layout_flops`, from the case's own layout)."""
    import tinyscale as ts
    from tinyscale.data import synthetic_token_batches
    from tinyscale.engine.throughput import early_stop_of, explicit_core_of, recompute_of
    from tinyscale.models import GPT

    out = []
    for name in names:
        model_options, config_options = _CASES[name]
        cfg = GPTConfig(vocab_size=63, max_seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=16, ffn_hidden=24,
                        tie_embeddings=True, **model_options)  # vocab 63: tp 2 pads a row; attn_impl "sdpa"
        config = {"train_batch_size": _ROWS, **config_options}
        engine = ts.initialize(GPT(cfg, seed=0, dtype=torch.float64), config)
        batch = synthetic_token_batches(num_batches=1, batch_size=_ROWS, seq_len=_SEQ, vocab_size=63, seed=0)[0]
        with FlopCounterMode(display=False, custom_mapping=CPU_FLASH) as counter:
            engine.train_batch(batch)
        plan, ec = engine.plan, engine.config
        recompute, layers = recompute_of(ec, cfg.n_layer)
        job = layout_flops(cfg, _SEQ, tp=plan.tp, cp=plan.cp, cp_algorithm=plan.context_algorithm,
                           cp_sharding=plan.context_sharding,
                           explicit_core=explicit_core_of(ec, cfg, tp=plan.tp, device=engine.device))
        hardware = job.hardware(recompute, layers, early_stop_of(ec, cfg, tp=plan.tp))
        out.append((counter.get_total_flops(), engine.throughput.tracker.hardware_flops_per_token, hardware))
    return out


# tp 2 x cp 2 (4 ranks, --thorough): Ulysses splits each tensor-parallel shard's heads over cp
_CASES_4 = {
    "tp2-cp2-ring-selective": ({}, {"parallel": {"tensor": 2, "context": 2},
                                    "activation_checkpointing": {"policy": "selective"}}),
    "tp2-cp2-ulysses-counter-dropout": (_COUNTER, {"parallel": {"tensor": 2, "context": 2,
                                                                "context_algorithm": "ulysses"}}),
}
_CASES.update(_CASES_4)


@functools.cache
def _layout_steps(world: int) -> dict[str, list[tuple[int, float, int]]]:
    from tinyscale.testing import run_on_ranks

    names = [name for name in _CASES if (name in _CASES_4) == (world == 4)]
    per_rank = run_on_ranks(_steps, world, names)
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(names)}


@pytest.mark.parametrize("case", [pytest.param(name, marks=pytest.mark.thorough if name in _CASES_4 else ())
                                  for name in _CASES])
def test_mfu_hfu_matches_flop_counter_under_context_and_tensor_parallelism(case):
    """Summed over the ranks, the step's FLOPs equal the rows' hardware FLOPs of the layout
    exactly, and the engine's HFU counts those per real token (padding and blocks included)."""
    per_rank = _layout_steps(4 if case in _CASES_4 else 2)[case]
    hardware = per_rank[0][2]
    assert all(h == hardware and per_token == hardware / _SEQ for _, per_token, h in per_rank)
    assert sum(flops for flops, _, _ in per_rank) == _ROWS * hardware
