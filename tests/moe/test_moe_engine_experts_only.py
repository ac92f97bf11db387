"""A model that trains only its experts (every other parameter frozen: expert fine-tuning) under
expert parallelism equals one process.

DDP then has no dense gradient at all: no bucket, and no dense parameter's hook to start the
end-of-backward callback that reduces the expert shards over their expert-data-parallel group.
Before the fix BucketedDDP failed to build (`self.buckets[-1]` of an empty list); with only the
dense hooks the experts' gradients would never be reduced. dp 4 x ep 2 (edp pairs), ZeRO 0,
float64 at rtol 1e-10 (the MoE tests' tolerance, tests/moe/test_moe_engine.py's docstring).
Run: `pytest tests/moe/test_moe_engine_experts_only.py` (keys moe, expert_parallel).
"""

from __future__ import annotations

import tinyscale as ts
from tinyscale.testing import assert_every_rank_trained_like, run_on_ranks

from .test_moe_engine import M, batches, engine_config, gpt, layout

SPEC = dict(layout(world=4, dp=4, ep=2, k=2, cf=0.8))


def experts_only(model):
    for name, p in model.named_parameters():
        p.requires_grad_(".experts." in name)
    assert any(p.requires_grad for p in model.parameters())
    return model


def _train(spec: dict):
    engine = ts.initialize(experts_only(gpt(spec)), engine_config(spec))
    return [engine.train_batch(b) for b in batches(spec)], engine.full_state_dict()


def test_moe_engine_expert_parallel_trains_only_the_experts_like_one_process():
    model = experts_only(gpt(SPEC))
    flat = engine_config(SPEC | {"dp": 1}) | {"parallel": {}}
    flat |= {"train_batch_size": M * SPEC["dp"], "gradient_accumulation_steps": M * SPEC["dp"]}
    losses = ts.reference.train(model, batches(SPEC), flat)
    ranks = run_on_ranks(_train, 4, SPEC, timeout_s=300)
    assert_every_rank_trained_like(ranks, losses, model.state_dict(), what="experts-only MoE, dp 4 x ep 2")
