"""The engine with `parallel.context` trains the GPT exactly like one process.

- cp = 2 with ring attention and with Ulysses, zigzag and contiguous sharding, tp 2 x cp 2
  with and without sequence parallelism (a cp shard SP cannot split fails on every rank, by name), and
  dp x cp = 2 x 2 at ZeRO stages 0 to 3 (gradients reduced over the flattened dp x cp group):
  losses and `full_state_dict()` equal `tinyscale.reference.train` (float64, rtol 1e-10), with
  GQA (4 query heads, 2 K/V heads), tied embeddings, a frozen and an unused parameter, a
  sequence of 7 tokens (padded to 8 for 2*cp = 4 chunks) and gradient clipping;
- a checkpoint written at cp = 2 resumes at dp = 2 and continues as one process;
- layouts the engine cannot serve are refused with a ConfigError naming the field, before any
  process group is made.
Run: `pytest tests/engine/test_engine_context_parallel.py` (keys engine_context_parallel,
ring_attention, ulysses, zigzag).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tinyscale as ts
from tinyscale.config import ConfigError, EngineConfig
from tinyscale.data import synthetic_token_batches
from tinyscale.engine import parallelize
from tinyscale.engine.engine import check_supported
from tinyscale.models import GPT, GPTConfig, TinyMLP
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks

GPT_CONFIG = GPTConfig(vocab_size=32, max_seq_len=8, n_layer=1, n_head=4, n_kv_head=2, d_model=16, ffn_hidden=24,
                       tie_embeddings=True)
ROWS, SEQ, STEPS = 4, 7, 2  # 7 tokens: not a multiple of 2 cp = 4 chunks, so zigzag pads
OPTIMIZERS = {  # SGD too: Adam hides a uniform gradient-scale bug (a missing or doubled sum over cp)
    "sgd": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}},
    "adamw": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}},
}
CLIP = 0.05  # the gradient norm here is ~1: every step clips


def model() -> GPT:
    """The GPT, one frozen parameter, and one that no forward uses (must not be stepped)."""
    gpt = GPT(GPT_CONFIG, seed=5, dtype=torch.float64)
    gpt.blocks[0].mlp_norm.weight.requires_grad_(False)
    gpt.unused = nn.Parameter(torch.ones(3, dtype=torch.float64))
    return gpt


def run_config(dp: int, cp: int, algorithm: str = "ring", sharding: str = "zigzag", stage: int = 0,
               optimizer: str = "sgd", clip: float = 0.0, tp: int = 1, sp: bool = False) -> dict:
    return {"train_batch_size": ROWS, "gradient_accumulation_steps": 2, "optimizer": OPTIMIZERS[optimizer],
            "gradient_clipping": clip, "zero_optimization": {"stage": stage},
            "parallel": {"context": cp, "tensor": tp}
            | ({"context_algorithm": algorithm, "context_sharding": sharding} if cp > 1 else {})
            | ({"sequence_parallel": True} if sp else {})}


def batches(steps: int = STEPS):
    return synthetic_token_batches(num_batches=steps, batch_size=ROWS, seq_len=SEQ,
                                   vocab_size=GPT_CONFIG.vocab_size, seed=3)


def reference(optimizer: str = "sgd", clip: float = 0.0, steps: int = STEPS):
    gpt = model()
    losses = ts.reference.train(gpt, batches(steps), run_config(1, 1, optimizer=optimizer, clip=clip))
    return losses, gpt.state_dict()


def _train_layouts(layouts: list[dict]) -> list:
    """Each layout (run_config's keywords) trained by a fresh engine on these ranks, one after another."""
    out = []
    for layout in layouts:
        engine = ts.initialize(model(), run_config(**layout))
        losses = [engine.train_batch(b) for b in batches()]
        out.append((losses, engine.full_state_dict(), engine.memory_report().bytes("parameters")))
    return out


def _check(results: list, layouts: list[dict]) -> None:
    full_bytes = sum(p.numel() * p.element_size() for p in model().parameters() if p.requires_grad)
    frozen_bytes = sum(p.numel() * p.element_size() for p in model().parameters() if not p.requires_grad)
    for rank, per_layout in enumerate(results):
        for layout, (losses, state, param_bytes) in zip(layouts, per_layout):
            expected_losses, expected = reference(layout.get("optimizer", "sgd"), layout.get("clip", 0.0))
            what = f"rank {rank}, {layout}"
            assert_losses_close(losses, expected_losses)
            assert list(state) == list(expected)  # the original keys, in order
            assert_state_dicts_close(state, expected, what=what)
            assert torch.equal(state["unused"], torch.ones(3, dtype=torch.float64)), what  # never stepped
            if layout.get("tp", 1) > 1:  # TP shards: their bytes are test_engine_tensor_parallel's business
                continue
            if layout.get("stage", 0) == 3:  # ZeRO-3 shards over all dp*cp ranks (frozen ones stay whole)
                ranks = layout["dp"] * layout["cp"]
                # 2 units (the block; the rest), each padded to a multiple of `ranks` float64 elements
                assert param_bytes - frozen_bytes <= full_bytes / ranks + 2 * (ranks - 1) * 8, what
            else:
                assert param_bytes == full_bytes + frozen_bytes, what


CP2_LAYOUTS = {  # on 2 ranks: cp = 2, dp = 1
    "ring_attention": [dict(dp=1, cp=2, algorithm="ring", sharding="zigzag"),
                       dict(dp=1, cp=2, algorithm="ring", sharding="contiguous", stage=3, optimizer="adamw")],
    "ulysses": [dict(dp=1, cp=2, algorithm="ulysses", sharding="zigzag", stage=1),
                dict(dp=1, cp=2, algorithm="ulysses", sharding="contiguous", clip=CLIP)],
}


@pytest.mark.parametrize("algorithm", list(CP2_LAYOUTS), ids=lambda a: f"{a}-zigzag-contiguous")
def test_engine_context_parallel_cp2_trains_like_one_process(algorithm):
    layouts = CP2_LAYOUTS[algorithm]
    _check(run_on_ranks(_train_layouts, 2, layouts), layouts)


DP2_CP2_LAYOUTS = [  # on 4 ranks: dp = 2 x cp = 2, ZeRO sharding over all 4
    dict(dp=2, cp=2, algorithm="ring", sharding="zigzag", stage=0),
    dict(dp=2, cp=2, algorithm="ulysses", sharding="zigzag", stage=3),
    dict(dp=2, cp=2, algorithm="ring", sharding="zigzag", stage=2, optimizer="adamw", clip=CLIP),
    dict(dp=2, cp=2, algorithm="ring", sharding="zigzag", stage=3, clip=CLIP),
]


def test_engine_context_parallel_dp2_cp2_zero_stages_ring_attention_ulysses_zigzag():
    _check(run_on_ranks(_train_layouts, 4, DP2_CP2_LAYOUTS), DP2_CP2_LAYOUTS)


def test_engine_context_parallel_zigzag_checkpoint_resumes_at_dp2(tmp_path):
    results = run_on_ranks(_resume_and_train, 2, str(tmp_path / "ckpt"))
    expected_losses, expected = reference("adamw")
    for losses, state in results:
        assert_losses_close(losses, expected_losses)
        assert_state_dicts_close(state, expected, what="parameters after resuming a cp=2 checkpoint at dp=2")


TP2_CP2_LAYOUTS = [  # on 4 ranks: cp = 2 x tp = 2 (2 query heads and 1 K/V head per TP shard)
    dict(dp=1, cp=2, tp=2, algorithm="ring", sharding="zigzag", clip=CLIP),
    dict(dp=1, cp=2, tp=2, algorithm="ulysses", sharding="contiguous", stage=3),
    # sequence parallelism too: each rank's 4 positions of a cp shard split again over tp
    dict(dp=1, cp=2, tp=2, sp=True, algorithm="ring", sharding="zigzag", clip=CLIP, optimizer="adamw"),
    dict(dp=1, cp=2, tp=2, sp=True, algorithm="ulysses", sharding="contiguous", stage=1),
]


def _sp_shard_too_short() -> str:
    """T = 5 in 2 contiguous chunks: 3 positions per cp rank, which tp 2 cannot split."""
    engine = ts.initialize(model(), run_config(1, 2, sharding="contiguous", tp=2, sp=True))
    batch = synthetic_token_batches(num_batches=1, batch_size=ROWS, seq_len=5, vocab_size=GPT_CONFIG.vocab_size,
                                    seed=3)[0]
    try:
        engine.train_batch(batch)
    except ValueError as exc:
        return str(exc)
    return "trained"


def test_engine_context_parallel_sequence_parallel_shard_tp_cannot_split_fails_every_rank_by_name():
    for message in run_on_ranks(_sp_shard_too_short, 4):
        assert "sequence parallelism cannot split" in message and "sequence_parallel false" in message, message


def test_engine_context_parallel_tp2_cp2_ring_attention_ulysses_trains_like_one_process():
    _check(run_on_ranks(_train_layouts, 4, TP2_CP2_LAYOUTS), TP2_CP2_LAYOUTS)


def _resume_and_train(path: str):
    data = batches()
    engine = ts.initialize(model(), run_config(1, 2, stage=3, optimizer="adamw"))
    losses = [engine.train_batch(data[0])]
    engine.save_checkpoint(path)
    other_model = model()
    with torch.no_grad():  # other values: the checkpoint must overwrite every one
        for p in other_model.parameters():
            p.add_(1.0)
    other = ts.initialize(other_model, run_config(2, 1, optimizer="adamw"))
    other.load_checkpoint(path)
    losses.append(other.train_batch(data[1]))
    return losses, other.full_state_dict()


def _bad_ids_body():
    """A token id past the vocab at a position only cp rank 1 holds; then the good batches."""
    engine = ts.initialize(model(), run_config(1, 2))
    inputs, targets = batches()[0]
    bad = inputs.clone()
    bad[0, 2] = GPT_CONFIG.vocab_size  # zigzag over 2 ranks: positions 2-5 are rank 1's
    try:
        engine.train_batch((bad, targets))
    except ValueError as exc:
        error = str(exc)
    else:
        error = None
    losses = [engine.train_batch(b) for b in batches()]  # the failed step left nothing behind
    return error, losses, engine.full_state_dict()


def test_engine_context_parallel_zigzag_bad_token_ids_fail_every_rank_together():
    """Checked on the whole rows before sharding: every cp rank raises, none waits in the ring."""
    expected_losses, expected = reference()
    for error, losses, state in run_on_ranks(_bad_ids_body, 2, timeout_s=120):
        assert error is not None and "inputs has token ids outside 0..31" in error and "[0, 2]" in error
        assert_losses_close(losses, expected_losses)
        assert_state_dicts_close(state, expected, what="parameters after a refused batch and two good ones")


# --- refused before any process group exists, the field named

def _refusal(config: dict, gpt: GPTConfig = GPT_CONFIG, world: int = 2):
    cfg = EngineConfig.load({"train_batch_size": ROWS, **config})
    check_supported(cfg)
    parallelize.check_layout(cfg, GPT(gpt) if gpt is not None else TinyMLP(), world)


@pytest.mark.parametrize(("config", "gpt", "world", "names"), [
    ({"parallel": {"context": 2}}, GPT_CONFIG, 3, ["parallel.context=2", "world size 3"]),
    ({"parallel": {"context": 2}}, GPT_CONFIG, 1, ["parallel.context=2", "world size 1"]),
    ({"parallel": {"context": 3, "context_algorithm": "ulysses"}}, GPT_CONFIG, 3,
     ["parallel.context=3", "context_algorithm", "n_head=4"]),
    ({"parallel": {"context": 2, "context_algorithm": "striped"}}, GPT_CONFIG, 2, ["parallel.context_algorithm"]),
    ({"parallel": {"context": 2, "context_sharding": "striped"}}, GPT_CONFIG, 2, ["parallel.context_sharding"]),
    ({"parallel": {"context": 2, "tensor": 2, "context_algorithm": "ulysses"}}, GPT_CONFIG.with_(n_head=2, n_kv_head=2),
     4, ["parallel.context=2", "ulysses", "parallel.tensor=2", "1 heads per rank"]),
    ({"parallel": {"context": 2}}, GPT_CONFIG.with_(dropout=0.1), 2,  # stream masks; counter: -k layout_dropout
     ["parallel.context=2", "dropout=0.1", "dropout_masks='counter'"]),
    ({"parallel": {"context": 2}}, None, 2, ["parallel.context=2", "TinyMLP"]),
    ({"parallel": {"context_algorithm": "ulysses"}}, GPT_CONFIG, 1,
     ["parallel.context_algorithm='ulysses' needs parallel.context > 1"]),
    ({"parallel": {"context_sharding": "contiguous"}}, GPT_CONFIG, 1,
     ["parallel.context_sharding='contiguous' needs parallel.context > 1"]),
], ids=["context_parallel_not_dividing_world", "context_parallel_one_process", "ulysses_heads_not_divisible",
        "context_parallel_unknown_algorithm", "zigzag_unknown_sharding",
        "ulysses_heads_per_tp_shard_not_divisible",
        "context_parallel_with_dropout", "context_parallel_not_a_gpt", "context_algorithm_without_cp",
        "context_sharding_without_cp"])
def test_engine_context_parallel_bad_layouts_are_refused_by_name(config, gpt, world, names):
    with pytest.raises(ConfigError) as err:
        _refusal(config, gpt, world)
    for name in names:
        assert name in str(err.value), (name, str(err.value))


@pytest.mark.parametrize("config", [
    {"activation_checkpointing": {"policy": "selective"}},
    {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
    {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
                           "offload_param": {"device": "cpu"}}},
], ids=["activation_checkpointing", "offload_optimizer", "offload_param"])
def test_engine_context_parallel_accepts_activation_checkpointing_and_offload(config):
    """Once refused as untested; trained bit-identically to the same layout without them in
    tests/engine/test_layout_activation_checkpointing.py and test_layout_offload.py."""
    _refusal({"parallel": {"context": 2}, **config})


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_engine_context_parallel_serves_mixed_precision(precision):
    """fp16/bf16 with cp (ring or Ulysses, and with tp) pass every check: they are served, and
    tests/engine/test_layout_mixed_precision.py trains them against one process."""
    for parallel in ({"context": 2}, {"context": 2, "context_algorithm": "ulysses", "tensor": 2}):
        _refusal({"parallel": parallel, precision: {"enabled": True}}, GPT_CONFIG, 4)
