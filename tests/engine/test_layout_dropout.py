"""Counter dropout (`GPTConfig.dropout_masks="counter"`) trains alike in every layout.

With dropout 0.1 on the attention probabilities and both residual branches, the engine in
dp 2 x tp 2 with sequence parallelism, dp 2 x cp 2 (ring with zigzag shards; Ulysses), tp 2 x
cp 2 (ring, zigzag), dp 2 x pp 2 (1F1B) and pp 2 x tp 2 (interleaved, 2 chunks per rank), and
dp 4 with full activation checkpointing (with --thorough also contiguous shards at dp 2 x cp 2
and tp 2 x cp 2), equals
`tinyscale.reference.train` in float64 at rtol 1e-10 over several steps with gradient
accumulation: each rank hashes the masks of its own rows, heads, positions and (query, key)
blocks from their global coordinates, which are one process's. The odd GPT: vocab 61, 6 query
and 2 K/V heads, tied embeddings, sequence 22 (zigzag pads it to 24), AdamW with weight decay,
clipping where the layout serves it. Checkpointing is bit-identical to no checkpointing, and a
run saved at dp 2 x pp 2 resumes at dp 2 x tp 2 with SP exactly (no generator state to carry).
Stream masks stay refused with pipeline and context parallelism, and `parallel.tensor_dropout`
with counter masks, each by name. The layouts of one world size run in one pooled call.
Run: `pytest tests/engine/test_layout_dropout.py` (key layout_dropout).
"""

from __future__ import annotations

import functools

import pytest
import torch

import tinyscale as ts
from tinyscale.config import ConfigError, EngineConfig
from tinyscale.data import synthetic_token_batches
from tinyscale.engine.parallelize import check_layout
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, max_abs_diff, run_on_ranks

VOCAB, SEQ, STEPS, MICRO, ACCUM, P = 61, 22, 3, 1, 2, 0.1


def gpt_config(n_layer: int = 3, masks: str = "counter", dropout: float = P) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=n_layer, n_head=6, n_kv_head=2, d_model=24,
                     ffn_hidden=32, tie_embeddings=True, dropout=dropout, dropout_masks=masks)


def run_config(dp: int, parallel: dict, clip: float, ac: str = "none") -> dict:
    return {"train_batch_size": MICRO * ACCUM * dp, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": ACCUM, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "activation_checkpointing": {"policy": ac}, "parallel": parallel}


def batches(dp: int):
    return synthetic_token_batches(num_batches=STEPS, batch_size=MICRO * ACCUM * dp, seq_len=SEQ,
                                   vocab_size=VOCAB, seed=11)


# (name, dp, n_layer, parallel, clip, activation checkpointing) on 4 ranks
WORLD4 = [
    ("dp2_tp2_sp", 2, 3, {"tensor": 2, "sequence_parallel": True}, 0.5, "none"),
    ("dp2_cp2_ring_zigzag", 2, 3, {"context": 2, "context_algorithm": "ring", "context_sharding": "zigzag"}, 0.5,
     "none"),
    ("dp2_cp2_ulysses", 2, 3, {"context": 2, "context_algorithm": "ulysses"}, 0.5, "none"),
    ("tp2_cp2_ring", 1, 3, {"tensor": 2, "context": 2, "context_algorithm": "ring"}, 0.0, "none"),
    ("dp2_pp2_1f1b", 2, 3, {"pipeline": 2, "pipeline_schedule": "1f1b"}, 0.5, "none"),
    ("pp2_tp2_interleaved", 1, 5, {"pipeline": 2, "pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2,
                                   "tensor": 2}, 0.5, "none"),
    ("dp4_full_checkpointing", 4, 3, {}, 0.5, "full"),
]
# With --thorough (a second pooled call): contiguous shards, with and without tensor parallelism
THOROUGH4 = [
    ("dp2_cp2_ring_contiguous", 2, 3, {"context": 2, "context_algorithm": "ring", "context_sharding": "contiguous"},
     0.0, "none"),
    ("tp2_cp2_ring_contiguous", 1, 3, {"tensor": 2, "context": 2, "context_sharding": "contiguous"}, 0.5,
     "none"),
]


def _hashable(layouts: list[tuple]) -> tuple:
    return tuple(layout[:3] + (tuple(layout[3].items()),) + layout[4:] for layout in layouts)


def _train_layouts(layouts: list[tuple]) -> list:
    """On each rank: every layout's losses and full state after STEPS steps (and, for the
    checkpointed layout, those of the same run without checkpointing, to compare bit for bit)."""
    out = []
    for _name, dp, n_layer, parallel, clip, ac in layouts:
        parallel, runs = dict(parallel), []
        for policy in (ac, "none") if ac != "none" else (ac,):
            engine = ts.initialize(GPT(gpt_config(n_layer), seed=7, dtype=torch.float64),
                                   run_config(dp, parallel, clip, policy))
            runs.append(([engine.train_batch(b) for b in batches(dp)], engine.full_state_dict()))
        out.append(runs)
    return out


@functools.cache
def results(world: int, layouts: tuple) -> list:  # parallel dicts as item tuples: hashable
    return run_on_ranks(_train_layouts, world, [layout[:3] + (dict(layout[3]),) + layout[4:] for layout in layouts])


@functools.cache
def reference(dp: int, n_layer: int, clip: float, dropout: float = P):
    model = GPT(gpt_config(n_layer, dropout=dropout), seed=7, dtype=torch.float64)
    losses = ts.reference.train(model, batches(dp), run_config(1, {}, clip) | {
        "train_batch_size": MICRO * ACCUM * dp, "gradient_accumulation_steps": ACCUM * dp})
    return losses, model.state_dict()


def _check(layouts: list[tuple], index: int) -> None:
    name, dp, n_layer, _parallel, clip, _ac = layouts[index]
    expected_losses, expected = reference(dp, n_layer, clip)
    for rank_runs in results(4, _hashable(layouts)):
        losses, state = rank_runs[index][0]
        assert_losses_close(losses, expected_losses)
        assert_state_dicts_close(state, expected, what=f"{name} full_state_dict after {STEPS} steps")


@pytest.mark.parametrize("index", range(len(WORLD4)), ids=[layout[0] for layout in WORLD4])
def test_layout_dropout_counter_masks_train_like_single_process(index):
    _check(WORLD4, index)


@pytest.mark.thorough
@pytest.mark.parametrize("index", range(len(THOROUGH4)), ids=[layout[0] for layout in THOROUGH4])
def test_layout_dropout_counter_masks_more_layouts_thorough(index):
    _check(THOROUGH4, index)


def _resume_in_another_layout(path: str):
    """Two steps at dp 2 x pp 2 (1F1B), a checkpoint, then a new engine at dp 2 x tp 2 with SP
    (other weights) loads it and takes the third step: its loss and state."""
    data = batches(2)
    first = ts.initialize(GPT(gpt_config(), seed=7, dtype=torch.float64),
                          run_config(2, {"pipeline": 2, "pipeline_schedule": "1f1b"}, 0.5))
    losses = [first.train_batch(b) for b in data[:2]]
    first.save_checkpoint(path)
    second = ts.initialize(GPT(gpt_config(), seed=8, dtype=torch.float64),
                           run_config(2, {"tensor": 2, "sequence_parallel": True}, 0.5))
    second.load_checkpoint(path)
    losses.append(second.train_batch(data[2]))
    return losses, second.full_state_dict()


def test_layout_dropout_resumes_exactly_in_another_layout(tmp_path):
    """No generator state travels: the masks of step 3 depend on (step, rows, ...) only."""
    expected_losses, expected = reference(2, 3, 0.5)
    for losses, state in run_on_ranks(_resume_in_another_layout, 4, str(tmp_path / "ckpt")):
        assert_losses_close(losses, expected_losses)
        assert_state_dicts_close(state, expected, what="dp 2 x tp 2 resumed from dp 2 x pp 2")


def test_layout_dropout_masks_drop_something():
    _, expected = reference(2, 3, 0.5)
    _, plain = reference(2, 3, 0.5, dropout=0.0)
    # the trained weights move away from dropout 0's by far more than rtol 1e-10 could hide
    assert max_abs_diff(expected, plain) > 1e-4


def test_layout_dropout_full_checkpointing_is_bit_identical():
    index = [layout[0] for layout in WORLD4].index("dp4_full_checkpointing")
    for rank_runs in results(4, _hashable(WORLD4)):
        (ckpt_losses, ckpt_state), (plain_losses, plain_state) = rank_runs[index]
        assert ckpt_losses == plain_losses
        assert all(torch.equal(ckpt_state[k], plain_state[k]) for k in plain_state)


@pytest.mark.parametrize(("parallel", "masks", "world", "needles"), [
    ({"pipeline": 2}, "stream", 2, ["parallel.pipeline=2", "dropout_masks='stream'", "dropout_masks='counter'"]),
    ({"context": 2}, "stream", 2, ["parallel.context=2", "dropout_masks='stream'", "dropout_masks='counter'"]),
    ({"tensor": 2, "tensor_dropout": "exact"}, "counter", 2, ["parallel.tensor_dropout='exact'", "counter"]),
], ids=["stream_with_pipeline", "stream_with_context", "tensor_dropout_with_counter"])
def test_layout_dropout_refuses_what_has_no_meaning(parallel, masks, world, needles):
    config = run_config(world // parallel.get("tensor", 1) // parallel.get("context", 1)
                        // parallel.get("pipeline", 1), parallel, 0.0)
    with pytest.raises(ConfigError) as info:
        check_layout(EngineConfig.load(config), GPT(gpt_config(masks=masks), seed=7, dtype=torch.float64), world)
    for needle in needles:
        assert needle in str(info.value)
