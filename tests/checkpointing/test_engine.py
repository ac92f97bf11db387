"""Policies under the engine: data parallelism (stage 0) and ZeRO-3 on 2 ranks train
bit-identically to the same engine without a policy, with dropout on (float64).

ZeRO-3 gathers a block's parameters for its forward and again for its backward; the
recomputation runs inside that backward, so it must find them gathered. The policy comes
from the config section `activation_checkpointing: {policy, every_k, use_reentrant}`,
which the engine applies with `apply_policy` before it wraps the model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.checkpointing import policy_of
from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import run_on_ranks


def _train(stage: int, policy: str, use_reentrant: bool):
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage},
              "activation_checkpointing": {"policy": policy, "use_reentrant": use_reentrant}}
    model = GPT(GPTConfig.preset("tiny").with_(dropout=0.1), seed=0, dtype=torch.float64)
    torch.manual_seed(dist.get_rank())  # each rank its own dropout masks, the same in both runs
    engine = ts.initialize(model, config)
    kind = {"none": "plain", "full": "checkpointed", "selective": "selective"}[policy]
    assert policy_of(model) == [kind] * 2  # the engine applied the configured policy, in place
    losses = [engine.train_batch(b) for b in synthetic_token_batches(num_batches=2, batch_size=8, seq_len=16, seed=0)]
    return losses, engine.full_state_dict()


@pytest.mark.parametrize("stage", [0, 3])
def test_activation_checkpoint_policies_under_engine_train_bit_identically(stage):
    plain = run_on_ranks(_train, 2, stage, "none", False)
    for policy, use_reentrant in [("full", False), ("full", True), ("selective", False)]:
        got = run_on_ranks(_train, 2, stage, policy, use_reentrant)
        for (losses, state), (ref_losses, ref_state) in zip(got, plain):
            assert losses == ref_losses, (policy, use_reentrant)
            assert list(state) == list(ref_state)
            assert all(torch.equal(state[k], ref_state[k]) for k in ref_state), (policy, use_reentrant)
