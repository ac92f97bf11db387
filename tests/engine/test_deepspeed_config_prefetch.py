"""DeepSpeed's stage3_prefetch_bucket_size and stage3_max_live_parameters (issue 17): how many
units stage 3 prefetches ahead, and the cap on gathered elements that prefetching respects;
training unchanged bit for bit. `pytest -k "deepspeed_config_prefetch or deepspeed_config_max_live"`."""

from __future__ import annotations

import pytest
import torch

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig
from tinyscale.zero.stage3_prefetch import units_to_prefetch

ROOT, BLOCK = 1032, 656  # elements of the GPT below on 2 ranks: root unit (embedding, norm, head), each block


def test_deepspeed_config_prefetch_rule():
    blocks = [BLOCK] * 4
    assert units_to_prefetch(blocks, 0, None, None) == 1  # tinyscale's default: one unit ahead
    assert units_to_prefetch(blocks, 0, 0, None) == 0  # 0: no prefetch
    assert units_to_prefetch(blocks, 0, 1, None) == 1  # DeepSpeed adds while fewer are in flight
    assert units_to_prefetch(blocks, 0, BLOCK, None) == 1 and units_to_prefetch(blocks, 0, BLOCK + 1, None) == 2
    assert units_to_prefetch(blocks, 0, 10**9, None) == 4
    assert units_to_prefetch(blocks, ROOT, 10**9, ROOT + 2 * BLOCK) == 2  # never above max_live
    assert units_to_prefetch(blocks, ROOT, 10**9, ROOT + 2 * BLOCK - 1) == 1
    assert units_to_prefetch([], ROOT, 10**9, None) == 0


def _run(zero_extra):
    model = GPT(GPTConfig(vocab_size=64, max_seq_len=8, n_layer=4, n_head=2, d_model=8, ffn_hidden=16),
                seed=0, dtype=torch.float64)
    engine = ts.initialize(model, {"train_batch_size": 4, "zero_optimization": {"stage": 3, **zero_extra}})
    for batch in synthetic_token_batches(num_batches=2, batch_size=4, seq_len=8, seed=0, vocab_size=64):
        engine.zero.peak_gathered = 0
        engine.train_batch(batch)
    zero = engine.zero  # step 2's events (step 1 guessed the order)
    kinds = [kind for kind, _, _ in zero.events if kind in ("forward", "backward", "prefetch")]
    per_forward = []  # prefetches issued by each unit's forward (root first, then blocks 0-3)
    for kind in kinds[:kinds.index("backward")]:
        if kind == "forward":
            per_forward.append(0)
        else:
            per_forward[-1] += 1
    sizes = [sum(zero.full[i].numel() for i in unit.flats) for unit in zero.units]
    peak = zero.peak_gathered  # before full_state_dict, which gathers every unit
    return engine.full_state_dict(), sizes, per_forward, peak


_VARIANTS = [{}, {"stage3_prefetch_bucket_size": 0}, {"stage3_prefetch_bucket_size": BLOCK + 1},
             {"stage3_prefetch_bucket_size": 10**8}]
_LIMITS = [ROOT + BLOCK, ROOT + 3 * BLOCK - 1]


def _all_variants():
    return [_run(v) for v in _VARIANTS] + [_run({"stage3_prefetch_bucket_size": 10**8,
                                                  "stage3_max_live_parameters": m}) for m in _LIMITS]


@pytest.fixture(scope="module")
def runs():
    from tinyscale.testing import run_on_ranks

    return run_on_ranks(_all_variants, 2)


def test_deepspeed_config_prefetch_bucket_size_sets_the_units_in_flight(runs):
    for rank in runs:
        (default, sizes, _, _) = rank[0]
        assert sizes == [BLOCK] * 4 + [ROOT]
        expected = [([1, 1, 1, 1, 0], ROOT + 2 * BLOCK),  # null: one unit ahead (tinyscale's default)
                    ([0, 0, 0, 0, 0], ROOT + BLOCK),      # 0: every unit gathered when it runs
                    ([2, 2, 0, 0, 0], ROOT + 4 * BLOCK),  # BLOCK + 1: two units per prefetch
                    ([4, 0, 0, 0, 0], ROOT + 4 * BLOCK)]  # 1e8: the root's forward prefetches every block
        for (state, _, per_forward, peak), (want, want_peak) in zip(rank[:4], expected):
            assert (per_forward, peak) == (want, want_peak)
            assert all(torch.equal(state[k], default[k]) for k in default)  # float64, bit for bit


def test_deepspeed_config_max_live_parameters_caps_what_prefetching_gathers(runs):
    for rank in runs:
        default = rank[0][0]
        for (state, _, per_forward, peak), limit in zip(rank[4:], _LIMITS):
            # the root (in use through the forward) and one block: gathered however low the cap;
            # beyond that, prefetching stops where the next unit would pass the cap
            assert peak == max(ROOT + BLOCK, ROOT + BLOCK * ((limit - ROOT) // BLOCK)) <= limit
            assert sum(per_forward) > 0
            assert all(torch.equal(state[k], default[k]) for k in default)


def test_deepspeed_config_prefetch_keys_auto_and_below_stage3():
    from tinyscale import EngineConfig
    from tinyscale.models import TinyMLP

    auto = EngineConfig.load({"train_batch_size": 4, "zero_optimization": {
        "stage": 3, "stage3_prefetch_bucket_size": "auto"}}).zero_optimization
    assert auto.stage3_prefetch_bucket_size is None and auto.stage3_max_live_parameters == 10**9  # one unit
    for name in ("stage3_prefetch_bucket_size", "stage3_max_live_parameters"):
        engine = ts.initialize(TinyMLP(seed=0), {"train_batch_size": 4, "zero_optimization": {"stage": 2, name: 100}})
        assert any(f"{name}: no effect at stages 0-2" in n for n in engine.config_notes)
