"""The engine with `parallel.tensor` (and `sequence_parallel`) trains the GPT exactly like one process.

- tp = 2 and 3, with and without sequence parallelism, dp x tp = 2 x 2 with DDP and ZeRO
  stages 1, 2 and 3 over the dp axis, tied and untied head: losses and `full_state_dict()`
  (original keys, unsharded) equal `tinyscale.reference.train` (float64, rtol 1e-10);
- `memory_report` counts this rank's shards;
- a checkpoint written at tp=2 resumes at tp=1 and the reverse, continuing as one process;
- layouts the engine cannot serve are refused with a ConfigError naming the field, before any
  process group is made.
Run: `pytest tests/engine/test_engine_tensor_parallel.py` (keys tp, tensor_parallel, sequence_parallel).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.config import ConfigError
from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig, TinyMLP
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks

VOCAB = 251  # prime: padded at every degree
ROWS = 4  # the global batch, the same for every layout

OPTIMIZERS = {  # SGD too: Adam hides a uniform gradient-scale bug (a missing or doubled reduction)
    "adamw": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}},
    "sgd": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}},
}


def gpt_config(tied: bool) -> GPTConfig:
    """6 query heads and 6 K/V heads... of which 2 or 3 per rank: splits over tp = 1, 2 and 3."""
    return GPTConfig(vocab_size=VOCAB, max_seq_len=12, n_layer=2, n_head=6, n_kv_head=6, d_model=24,
                     ffn_hidden=36, tie_embeddings=tied)


def run_config(tp: int, dp: int, optimizer: str, sp: bool = False, stage: int = 0, clip: float = 0.0) -> dict:
    return {"train_batch_size": ROWS, "train_micro_batch_size_per_gpu": ROWS // (2 * dp),
            "gradient_accumulation_steps": 2, "optimizer": OPTIMIZERS[optimizer], "gradient_clipping": clip,
            "zero_optimization": {"stage": stage}, "parallel": {"tensor": tp, "sequence_parallel": sp}}


def batches(steps: int):
    return synthetic_token_batches(num_batches=steps, batch_size=ROWS, seq_len=12, vocab_size=VOCAB, seed=3)


def reference(tied: bool, optimizer: str, steps: int, clip: float = 0.0):
    model = GPT(gpt_config(tied), seed=5, dtype=torch.float64)
    losses = ts.reference.train(model, batches(steps), run_config(1, 1, optimizer, clip=clip))
    return losses, model.state_dict()


def _train_body(config: dict, tied: bool, steps: int):
    engine = ts.initialize(GPT(gpt_config(tied), seed=5, dtype=torch.float64), config)
    losses = [engine.train_batch(b) for b in batches(steps)]
    # This rank's TP shards (tied: one Parameter), as split before ZeRO-3 cut them over dp.
    names = dict(engine.model.named_parameters())
    local = sum(torch.Size(engine._tp_shapes[n]).numel() * p.element_size() for n, p in names.items())
    return losses, engine.full_state_dict(), engine.memory_report().bytes("parameters"), local


# (world, tp, sequence_parallel, zero stage, tied, optimizer)
LAYOUTS = [(2, 2, False, 0, True, "sgd"), (4, 2, True, 0, False, "adamw"), (3, 3, False, 0, True, "adamw"),
           (3, 3, True, 0, False, "sgd"), (4, 2, False, 1, True, "adamw"), (4, 2, True, 2, False, "sgd"),
           (4, 2, False, 3, True, "adamw")]


def _id(world, tp, sp, stage, tied, optimizer):
    sp_key = "sequence_parallel" if sp else "no_sp"
    return f"tp{tp}-dp{world // tp}-{sp_key}-zero{stage}-{'tied' if tied else 'untied'}-{optimizer}"


@pytest.mark.parametrize(("world", "tp", "sp", "stage", "tied", "optimizer"),
                         [pytest.param(*layout, id=_id(*layout)) for layout in LAYOUTS])
def test_engine_tensor_parallel_trains_like_single_process(world, tp, sp, stage, tied, optimizer):
    steps = 2
    config = run_config(tp, world // tp, optimizer, sp, stage)
    results = run_on_ranks(_train_body, world, config, tied, steps)
    expected_losses, expected = reference(tied, optimizer, steps)
    full_bytes = sum(v.numel() * v.element_size() for v in GPT(gpt_config(tied), dtype=torch.float64).parameters())
    for losses, state, param_bytes, local_bytes in results:
        assert_losses_close(losses, expected_losses)
        assert list(state) == list(expected)  # the original keys, in order; padding and shards gone
        assert_state_dicts_close(state, expected, what=f"full_state_dict after {steps} steps")
        # This rank's shards: 1/tp of the split matrices (the vocab padded), never the full model;
        # ZeRO-3 then keeps about 1/dp of those.
        assert full_bytes / tp < local_bytes < full_bytes
        if stage < 3:
            assert param_bytes == local_bytes
        else:
            assert local_bytes / (world // tp) <= param_bytes < local_bytes


@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sequence_parallel"])
def test_engine_tensor_parallel_clips_by_the_full_models_norm(sp):
    """tp2 x dp2 at stage 0 with a max norm the gradients exceed: the clipped steps equal one process's."""
    steps, clip = 2, 0.05  # the gradient norm here is ~1: every step clips
    config = run_config(2, 2, "sgd", sp, clip=clip)
    results = run_on_ranks(_train_body, 4, config, True, steps)
    expected_losses, expected = reference(True, "sgd", steps, clip)
    for losses, state, _, _ in results:
        assert_losses_close(losses, expected_losses)
        assert_state_dicts_close(state, expected, what="parameters after clipped steps")


def _resume_body(path: str, first_tp: int, then_tp: int, steps: int):
    """Train `steps` at tp=first_tp, save; a new engine at tp=then_tp loads it and trains `steps` more."""
    data = batches(2 * steps)
    world = dist.get_world_size()
    engine = ts.initialize(GPT(gpt_config(True), seed=5, dtype=torch.float64),
                           run_config(first_tp, world // first_tp, "adamw"))
    losses = [engine.train_batch(b) for b in data[:steps]]
    engine.save_checkpoint(path)
    other = ts.initialize(GPT(gpt_config(True), seed=99, dtype=torch.float64),  # other values: all must load
                          run_config(then_tp, world // then_tp, "adamw"))
    other.load_checkpoint(path)
    losses += [other.train_batch(b) for b in data[steps:]]
    return losses, other.full_state_dict()


@pytest.mark.parametrize(("first_tp", "then_tp"), [(2, 1), (1, 2)], ids=["tp2_to_tp1", "tp1_to_tp2"])
def test_engine_tensor_parallel_checkpoint_resumes_across_tp_degrees(tmp_path, first_tp, then_tp):
    steps = 2
    results = run_on_ranks(_resume_body, 2, str(tmp_path / "ckpt"), first_tp, then_tp, steps)
    expected_losses, expected = reference(True, "adamw", 2 * steps)
    for losses, state in results:
        assert_losses_close(losses, expected_losses)
        assert_state_dicts_close(state, expected, what="parameters after resuming at another tp")


def _base(**extra) -> dict:
    return {"train_batch_size": 2, "optimizer": OPTIMIZERS["sgd"], **extra}


@pytest.mark.parametrize(("model", "config", "names"), [
    ("gpt", {"parallel": {"tensor": 2}}, ["parallel.tensor=2", "world size 1"]),  # one process
    ("gpt", {"parallel": {"tensor": 4}}, ["parallel.tensor=4", "n_head", "6"]),   # 6 heads over 4 ranks
    ("mlp", {"parallel": {"tensor": 2}}, ["parallel.tensor=2", "TinyMLP"]),
    ("gpt", {"parallel": {"sequence_parallel": True}}, ["parallel.sequence_parallel", "parallel.tensor"]),
    ("gpt", {"parallel": {"tensor": 2}, "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}},
     ["gradient_clipping", "parallel.tensor=2", "zero_optimization.stage=1"]),
    ("gpt", {"parallel": {"tensor": 2}, "bf16": {"enabled": True}}, ["bf16.enabled", "parallel.tensor=2"]),
    ("gpt", {"parallel": {"tensor": 2}, "activation_checkpointing": {"policy": "full"}},
     ["activation_checkpointing.policy", "parallel.tensor=2"]),
], ids=["tp_not_dividing_world", "tp_heads_not_divisible", "tp_not_a_gpt", "sequence_parallel_without_tp",
        "tp_with_clipping_at_zero1", "tp_with_bf16", "tp_with_activation_checkpointing"])
def test_engine_tensor_parallel_bad_layouts_are_refused_by_name(model, config, names):
    net = GPT(gpt_config(False), seed=0, dtype=torch.float64) if model == "gpt" else TinyMLP(dim=4, hidden=8)
    with pytest.raises(ConfigError) as err:  # in a plain process: refused before any group is needed
        ts.initialize(net, _base(**config))
    for name in names:
        assert name in str(err.value)


def test_train_preset_tp_layout_is_refused_before_any_process_when_the_world_cannot_split():
    from tinyscale.train import make_spec

    assert make_spec("tp", world_size=2).config["parallel"]["tensor"] == 2  # dp 1 x tp 2
    with pytest.raises(ConfigError, match=r"parallel\.tensor=2 does not divide the world size 3"):
        make_spec("tp", world_size=3)
