"""The engine's activation_checkpointing section (`pytest -k activation_checkpoint`): every
policy, under DDP and ZeRO-3, trains bit-identically to no checkpointing, dropout on."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.checkpointing import policy_of
from tinyscale.config import ConfigError
from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import run_on_ranks

POLICIES = [{"policy": "full"}, {"policy": "every_k", "every_k": 2}, {"policy": "selective"},
            {"policy": "offload"}, {"policy": "full", "use_reentrant": True}]


def _train(stage, ac):
    world = dist.get_world_size()
    torch.manual_seed(1234 + dist.get_rank())  # dropout masks differ per rank, as in real training
    cfg = GPTConfig(vocab_size=256, max_seq_len=16, n_layer=3, n_head=4, d_model=16, ffn_hidden=40, dropout=0.1)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage},
              "activation_checkpointing": ac}
    engine = ts.initialize(GPT(cfg, seed=0, dtype=torch.float64), config)
    batches = synthetic_token_batches(num_batches=2, batch_size=4 * world, seq_len=16, seed=0)
    return [engine.train_batch(b) for b in batches], engine.full_state_dict(), policy_of(engine.model)


@pytest.mark.parametrize("stage", [0, 3])
def test_activation_checkpoint_policies_through_the_engine_are_bit_identical(stage):
    plain = run_on_ranks(_train, 2, stage, {"policy": "none"})
    for ac in POLICIES:
        for (losses, state, kinds), (ref_losses, ref_state, _) in zip(run_on_ranks(_train, 2, stage, ac), plain):
            assert kinds != ["plain"] * 3, ac  # the policy was applied ...
            assert losses == ref_losses, ac  # ... and changed no number
            assert all(torch.equal(state[k], ref_state[k]) for k in state), ac


def test_activation_checkpoint_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="every_k goes with policy 'every_k'"):
        ts.EngineConfig.load({"train_batch_size": 2, "activation_checkpointing": {"policy": "full", "every_k": 2}})
    with pytest.raises(ConfigError, match="activation_checkpointing.policy"):
        ts.EngineConfig.load({"train_batch_size": 2, "activation_checkpointing": {"policy": "sometimes"}})
