"""The engine with `parallel.tensor` (and `sequence_parallel`) trains the GPT exactly like one process.

- tp = 2 and 3, with and without sequence parallelism, dp x tp = 2 x 2 with DDP and ZeRO
  stages 1, 2 and 3 over the dp axis, tied and untied head: losses and `full_state_dict()`
  (original keys, unsharded) equal `tinyscale.reference.train` (float64, rtol 1e-10);
- the issue's acceptance: tp 4 and dp 2 x tp 2 at ZeRO 0-3 (offload at 2 and 3), GQA with K/V
  heads replicated or split, tied, vocab 251, 3 layers, dropout in the exact mode, clipping;
- `memory_report` counts this rank's shards;
- a checkpoint written at tp=2 resumes at tp=1 and the reverse, replicated K/V heads reshard
  tp 4 <-> tp 2, continuing as one process;
- a TP peer's failed step is dropped by every rank;
- layouts the engine cannot serve are refused with a ConfigError naming the field, before any
  process group is made.
Tracker-mode dropout: `test_engine_tensor_parallel_dropout.py`.
Run: `pytest tests/engine/test_engine_tensor_parallel.py` (keys tp, tensor_parallel, sequence_parallel).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tests.engine.test_layout_matrix import nonzero_biases
from tinyscale.config import ConfigError
from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig, TinyMLP
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks, with_vocab_boundary_ids

VOCAB = 251  # prime: padded at every degree
ROWS = 4  # the global batch, the same for every layout

OPTIMIZERS = {  # SGD too: Adam hides a uniform gradient-scale bug (a missing or doubled reduction)
    "adamw": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}},
    "sgd": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}},
}


def gpt_config(tied: bool, n_kv_head: int = 6) -> GPTConfig:
    """6 query heads and 6 K/V heads... of which 2 or 3 per rank: splits over tp = 1, 2 and 3
    (n_kv_head=1: the one K/V head replicated on every rank)."""
    return GPTConfig(vocab_size=VOCAB, max_seq_len=12, n_layer=2, n_head=6, n_kv_head=n_kv_head, d_model=24,
                     ffn_hidden=36, tie_embeddings=tied)


def run_config(tp: int, dp: int, optimizer: str, sp: bool = False, stage: int = 0, clip: float = 0.0) -> dict:
    return {"train_batch_size": ROWS, "train_micro_batch_size_per_gpu": ROWS // (2 * dp),
            "gradient_accumulation_steps": 2, "optimizer": OPTIMIZERS[optimizer], "gradient_clipping": clip,
            "zero_optimization": {"stage": stage}, "parallel": {"tensor": tp, "sequence_parallel": sp}}


def batches(steps: int):
    """Every id at a vocab-shard boundary of tp 2 and 3 is looked up and scored (random ids miss them)."""
    data = synthetic_token_batches(num_batches=steps, batch_size=ROWS, seq_len=12, vocab_size=VOCAB, seed=3)
    return with_vocab_boundary_ids(data, VOCAB, (2, 3))


def reference(tied: bool, optimizer: str, steps: int, clip: float = 0.0, n_kv_head: int = 6):
    model = GPT(gpt_config(tied, n_kv_head), seed=5, dtype=torch.float64)
    losses = ts.reference.train(model, batches(steps), run_config(1, 1, optimizer, clip=clip))
    return losses, model.state_dict()


def _train_body(config: dict, tied: bool, steps: int):
    engine = ts.initialize(GPT(gpt_config(tied), seed=5, dtype=torch.float64), config)
    losses = [engine.train_batch(b) for b in batches(steps)]
    # This rank's TP shards (tied: one Parameter), as split before ZeRO-3 cut them over dp.
    names = dict(engine.model.named_parameters())
    local = sum(torch.Size(engine._tp_shapes[n]).numel() * p.element_size() for n, p in names.items())
    return losses, engine.full_state_dict(), engine.memory_report().bytes("parameters"), local


# (world, tp, sequence_parallel, zero stage, tied, optimizer): one pooled launch per world runs them all
LAYOUTS = [(2, 2, False, 0, True, "sgd"), (4, 2, True, 0, False, "adamw"), (3, 3, False, 0, True, "adamw"),
           (3, 3, True, 0, False, "sgd"), (4, 2, False, 1, True, "adamw"), (4, 2, True, 2, False, "sgd"),
           (4, 2, False, 3, True, "adamw")]


def _layouts_body(runs: list[tuple[dict, bool]], steps: int):
    return [_train_body(config, tied, steps) for config, tied in runs]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_engine_tensor_parallel_trains_like_single_process(world):
    steps = 2
    layouts = [layout for layout in LAYOUTS if layout[0] == world]
    runs = [(run_config(tp, world // tp, optimizer, sp, stage), tied) for _, tp, sp, stage, tied, optimizer in layouts]
    per_rank = run_on_ranks(_layouts_body, world, runs, steps)
    for k, (_, tp, sp, stage, tied, optimizer) in enumerate(layouts):
        expected_losses, expected = reference(tied, optimizer, steps)
        full_bytes = sum(v.numel() * v.element_size()
                         for v in GPT(gpt_config(tied), dtype=torch.float64).parameters())
        for rank_results in per_rank:
            losses, state, param_bytes, local_bytes = rank_results[k]
            assert_losses_close(losses, expected_losses)
            assert list(state) == list(expected)  # the original keys, in order; padding and shards gone
            assert_state_dicts_close(state, expected, what=f"full_state_dict, tp={tp} sp={sp} zero{stage}")
            # This rank's shards: 1/tp of the split matrices (the vocab padded), never the full model;
            # ZeRO-3 then keeps about 1/dp of those.
            assert full_bytes / tp < local_bytes < full_bytes
            if stage < 3:
                assert param_bytes == local_bytes
            else:
                assert local_bytes / (world // tp) <= param_bytes < local_bytes


# The acceptance: GQA with K/V heads replicated at tp 4 (2 heads) and split at tp 2, tied
# embeddings, a vocab (251) and a layer count (3) that divide by nothing here, dropout 0.1 in the
# exact mode, and every step clipped (the norm is ~1): tp 4, then dp 2 x tp 2 at every ZeRO stage
# (at stages 2 and 3 with the optimizer states offloaded to host memory, at 3 the parameters too).
# Linear biases (GPT-2's): the copied K/V heads' biases at tp 4, row-parallel biases added once.
ACCEPTANCE = GPTConfig(vocab_size=VOCAB, max_seq_len=8, n_layer=3, n_head=4, n_kv_head=2, d_model=16,
                       ffn_hidden=24, tie_embeddings=True, dropout=0.1, bias=True)
DROPOUT_SEED = 17  # rank 0's generator; the engine gives it to every rank (exact mode)


def acceptance_config(tp: int, stage: int, sp: bool, offload: bool = False) -> dict:
    dp, zero = 4 // tp, {"stage": stage}
    if offload:  # optimizer states (and at stage 3 the parameter shards) in host memory
        zero.update(offload_optimizer={"device": "cpu"}, **({"offload_param": {"device": "cpu"}} if stage == 3 else {}))
    return {"train_batch_size": ROWS, "train_micro_batch_size_per_gpu": 1,  # the reference's micro-batches
            "gradient_accumulation_steps": ROWS // dp, "optimizer": OPTIMIZERS["sgd"], "gradient_clipping": 0.05,
            "zero_optimization": zero, "parallel": {"tensor": tp, "sequence_parallel": sp}}


def acceptance_batches(steps: int):
    data = synthetic_token_batches(num_batches=steps, batch_size=ROWS, seq_len=8, vocab_size=VOCAB, seed=4)
    return with_vocab_boundary_ids(data, VOCAB, (4,))  # the 8 ids at tp 4's boundaries and the ends


def _acceptance_body(layouts: list[tuple[int, int, bool, bool]], steps: int):
    out = []
    for tp, stage, sp, offload in layouts:
        # (its nn.Linear init draws from the global RNG: the seed below comes after it)
        model = nonzero_biases(GPT(ACCEPTANCE, seed=5, dtype=torch.float64))
        torch.manual_seed(DROPOUT_SEED + 1000 * dist.get_rank())  # only rank 0's seed may matter
        engine = ts.initialize(model, acceptance_config(tp, stage, sp, offload))
        out.append(([engine.train_batch(b) for b in acceptance_batches(steps)], engine.full_state_dict()))
    return out


def test_engine_tensor_parallel_acceptance_layouts_with_dropout_gqa_and_clipping_train_like_single_process():
    steps = 2  # (tp, zero stage, sequence parallel, offload)
    layouts = [(4, 0, True, False), (2, 0, False, False), (2, 1, True, False), (2, 2, False, True), (2, 3, True, True)]
    model = nonzero_biases(GPT(ACCEPTANCE, seed=5, dtype=torch.float64))
    torch.manual_seed(DROPOUT_SEED)
    expected_losses = ts.reference.train(model, acceptance_batches(steps), acceptance_config(1, 0, False))
    expected = model.state_dict()
    for rank_results in run_on_ranks(_acceptance_body, 4, layouts, steps):
        for (tp, stage, sp, offload), (losses, state) in zip(layouts, rank_results):
            assert_losses_close(losses, expected_losses)
            assert_state_dicts_close(state, expected, what=f"tp={tp} x dp={4 // tp}, zero{stage}, sp={sp}, "
                                                          f"offload={offload}")
    no_dropout = GPT(ACCEPTANCE.with_(dropout=0.0), seed=5, dtype=torch.float64)
    plain = ts.reference.train(no_dropout, acceptance_batches(1), acceptance_config(1, 0, False))
    assert abs(plain[0] - expected_losses[0]) > 1e-6  # dropout did change the losses


def _resume_body(path: str, directions: list[tuple[int, int]], steps: int):
    """Per direction: train `steps` at tp=first_tp, save; a new engine at tp=then_tp loads it
    and trains `steps` more. One K/V head: replicated at tp 2, saved once, loaded into each copy."""
    data, world, out = batches(2 * steps), dist.get_world_size(), []
    for k, (first_tp, then_tp) in enumerate(directions):
        engine = ts.initialize(GPT(gpt_config(True, 1), seed=5, dtype=torch.float64),
                               run_config(first_tp, world // first_tp, "adamw"))
        losses = [engine.train_batch(b) for b in data[:steps]]
        engine.save_checkpoint(f"{path}-{k}")
        other = ts.initialize(GPT(gpt_config(True, 1), seed=99, dtype=torch.float64),  # other values: all must load
                              run_config(then_tp, world // then_tp, "adamw"))
        other.load_checkpoint(f"{path}-{k}")
        losses += [other.train_batch(b) for b in data[steps:]]
        out.append((losses, other.full_state_dict()))
    return out


def test_engine_tensor_parallel_checkpoint_resumes_across_tp_degrees(tmp_path):
    steps, directions = 1, [(2, 1), (1, 2)]  # 1 step saved (AdamW's state exists), 1 resumed with it
    expected_losses, expected = reference(True, "adamw", 2 * steps, n_kv_head=1)
    for rank_results in run_on_ranks(_resume_body, 2, str(tmp_path / "ckpt"), directions, steps):
        for (first_tp, then_tp), (losses, state) in zip(directions, rank_results):
            assert_losses_close(losses, expected_losses)
            assert_state_dicts_close(state, expected, what=f"parameters after tp={first_tp} -> tp={then_tp}")


def _reshard_kv_body(path: str, directions: list[tuple[int, int]], steps: int):
    """The acceptance model without dropout: 2 K/V heads, replicated at tp 4, split at tp 2 (dp 2)."""
    data, out = acceptance_batches(2 * steps), []
    for k, (first_tp, then_tp) in enumerate(directions):
        engine = ts.initialize(GPT(ACCEPTANCE.with_(dropout=0.0), seed=5, dtype=torch.float64),
                               acceptance_config(first_tp, 0, False))
        losses = [engine.train_batch(b) for b in data[:steps]]
        engine.save_checkpoint(f"{path}-{k}")
        other = ts.initialize(GPT(ACCEPTANCE.with_(dropout=0.0), seed=99, dtype=torch.float64),
                              acceptance_config(then_tp, 0, False))
        other.load_checkpoint(f"{path}-{k}")
        out.append((losses + [other.train_batch(b) for b in data[steps:]], other.full_state_dict()))
    return out


def test_engine_tensor_parallel_checkpoint_reshards_replicated_kv_heads(tmp_path):
    """Saved at tp 4 (each K/V head on 2 ranks: one copy saved), loaded at tp 2, and the reverse."""
    steps, directions = 1, [(4, 2), (2, 4)]  # 1 step saved (momentum exists), 1 resumed with it
    model = GPT(ACCEPTANCE.with_(dropout=0.0), seed=5, dtype=torch.float64)
    expected_losses = ts.reference.train(model, acceptance_batches(2 * steps), acceptance_config(1, 0, False))
    for rank_results in run_on_ranks(_reshard_kv_body, 4, str(tmp_path / "ckpt"), directions, steps):
        for (first_tp, then_tp), (losses, state) in zip(directions, rank_results):
            assert_losses_close(losses, expected_losses)
            assert_state_dicts_close(state, model.state_dict(), what=f"after tp={first_tp} -> tp={then_tp}")


def _failed_step_body(steps: int):
    """tp 2: TP rank 1's backward raises once, after the last collective its peer makes in the
    step (the last micro-batch's gradient reaching the embedding's output: a rank failing before
    that leaves its TP peers waiting in a collective, caught only by the timeout); then every
    batch trains."""
    engine = ts.initialize(GPT(gpt_config(True), seed=5, dtype=torch.float64), run_config(2, 1, "sgd"))
    trap = {"armed": True, "forwards": 0}

    def throw(grad):
        raise MemoryError("simulated: backward")

    def arm(module, args, out):
        trap["forwards"] += 1
        if trap["armed"] and dist.get_rank() == 1 and trap["forwards"] == 2:  # the last of 2 micro-batches
            out.register_hook(throw)
    engine.model.embed.register_forward_hook(arm)
    data = batches(steps)
    try:
        engine.train_batch(data[0])
        raised = None
    except Exception as exc:  # noqa: BLE001 - the test asserts which
        raised = type(exc).__name__
    trap["armed"] = False
    return raised, [engine.train_batch(b) for b in data], engine.full_state_dict()


def test_engine_tensor_parallel_failed_step_is_agreed_by_the_tp_peers():
    """The TP peer that did not raise learns of the failure and drops the step too (StepFailed);
    the retried steps equal one process's."""
    steps = 2
    results = run_on_ranks(_failed_step_body, 2, steps)
    expected_losses, expected = reference(True, "sgd", steps)
    assert [raised for raised, _, _ in results] == ["StepFailed", "MemoryError"]
    for _, losses, state in results:
        assert_losses_close(losses, expected_losses)
        assert_state_dicts_close(state, expected, what="parameters after a failed step and its retry")


def _base(**extra) -> dict:
    return {"train_batch_size": 2, "optimizer": OPTIMIZERS["sgd"], **extra}


@pytest.mark.parametrize(("model", "config", "names"), [
    ("gpt", {"parallel": {"tensor": 2}}, ["parallel.tensor=2", "world size 1"]),  # one process
    ("gpt", {"parallel": {"tensor": 4}}, ["parallel.tensor=4", "n_head", "6"]),   # 6 heads over 4 ranks
    # a model of the user's: AutoTP (tensor_parallel/auto.py) names the layers it cannot place
    ("mlp", {"parallel": {"tensor": 2}}, ["parallel.tensor=2", "AutoTP cannot place 3 module(s): fc_in (Linear), "
                                          "shared (Linear), frozen (Linear)", "parallel.tp_plan"]),
    ("gpt", {"parallel": {"sequence_parallel": True}}, ["parallel.sequence_parallel", "parallel.tensor"]),
    ("gpt", {"parallel": {"tensor_dropout": "tracker"}}, ["parallel.tensor_dropout", "parallel.tensor"]),
    ("gpt", {"parallel": {"tensor": 2, "tensor_dropout": "fast"}}, ["parallel.tensor_dropout", "exact", "tracker"]),
], ids=["tp_not_dividing_world", "tp_heads_not_divisible", "tp_layers_autotp_cannot_place", "sequence_parallel_without_tp",
        "tensor_dropout_without_tp", "tp_dropout_mode_unknown"])
def test_engine_tensor_parallel_bad_layouts_are_refused_by_name(model, config, names):
    net = GPT(gpt_config(False), seed=0, dtype=torch.float64) if model == "gpt" else TinyMLP(dim=4, hidden=8)
    with pytest.raises(ConfigError) as err:  # in a plain process: refused before any group is needed
        ts.initialize(net, _base(**config))
    for name in names:
        assert name in str(err.value)


def test_engine_tensor_parallel_accepts_activation_checkpointing():
    """Once refused as untested: now checked only for the world it needs (bit-identical to no
    checkpointing, dropout on: tests/engine/test_layout_activation_checkpointing.py)."""
    net = GPT(gpt_config(False), seed=0, dtype=torch.float64)
    with pytest.raises(ConfigError) as err:
        ts.initialize(net, _base(parallel={"tensor": 2}, activation_checkpointing={"policy": "full"}))
    assert "world size 1" in str(err.value) and "activation_checkpointing" not in str(err.value)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_engine_tensor_parallel_serves_mixed_precision(precision):
    """fp16/bf16 with tp (and sequence parallelism) pass the config checks: they are served, and
    tests/engine/test_layout_mixed_precision.py trains them against one process."""
    from tinyscale.config import EngineConfig
    from tinyscale.engine.engine import check_supported

    check_supported(EngineConfig.load(_base(parallel={"tensor": 2, "sequence_parallel": True},
                                            **{precision: {"enabled": True}})))


def test_train_preset_tp_layout_is_refused_before_any_process_when_the_world_cannot_split():
    from tinyscale.train import make_spec

    assert make_spec("tp", world_size=2).config["parallel"]["tensor"] == 2  # dp 1 x tp 2
    with pytest.raises(ConfigError, match=r"parallel\.tensor=2 does not divide the world size 3"):
        make_spec("tp", world_size=3)


# An MoE GPT with linear biases: block 0 dense (its MLP's biases split), block 1 MoE (attention
# biases split, the experts whole on every TP rank and bias-free); tp 2, and pp 2 (a stage each).
MOE_BIAS = GPTConfig(vocab_size=VOCAB, max_seq_len=6, n_layer=2, n_head=4, n_kv_head=2, d_model=8, ffn_hidden=12,
                     tie_embeddings=True, bias=True, moe_experts=2, moe_top_k=1, moe_layers=(1,))
MOE_BIAS_LAYOUTS = [{"tensor": 2}, {"pipeline": 2}]


def _moe_bias_config(parallel: dict) -> dict:
    return {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
            "optimizer": OPTIMIZERS["sgd"], "gradient_clipping": 0.3, "parallel": parallel}


def _moe_bias_batches():
    return synthetic_token_batches(num_batches=2, batch_size=2, seq_len=6, vocab_size=VOCAB, seed=8)


def _moe_bias_body():
    out = []
    for parallel in MOE_BIAS_LAYOUTS:
        engine = ts.initialize(nonzero_biases(GPT(MOE_BIAS, seed=5, dtype=torch.float64)), _moe_bias_config(parallel))
        out.append(([engine.train_batch(b) for b in _moe_bias_batches()], engine.full_state_dict()))
    return out


def test_engine_tensor_parallel_moe_gpt_with_biases_trains_like_single_process():
    model = nonzero_biases(GPT(MOE_BIAS, seed=5, dtype=torch.float64))
    expected_losses = ts.reference.train(model, _moe_bias_batches(), _moe_bias_config({}))
    expected = model.state_dict()
    assert "blocks.1.attn.wo.bias" in expected and "blocks.0.mlp.w_down.bias" in expected
    assert not any(k.startswith("blocks.1.mlp.") and k.endswith(".bias") for k in expected)
    for rank_results in run_on_ranks(_moe_bias_body, 2):
        for parallel, (losses, state) in zip(MOE_BIAS_LAYOUTS, rank_results):
            assert_losses_close(losses, expected_losses)
            assert list(state) == list(expected)
            assert_state_dicts_close(state, expected, what=f"MoE GPT with biases, {parallel}")
