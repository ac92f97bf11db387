"""The layout matrix: every (dp, pp, cp, tp) with degrees in {1, 2} on at most 8 ranks, plus a few
with a degree of 3, each crossed with a ZeRO stage, sequence parallelism, activation checkpointing
and a pipeline schedule, trains the odd GPT exactly like one process.

The odd GPT is what a user brings, not what divides evenly: vocab 61 (no degree divides it: the
TP vocab shards are padded), 5 layers (no pipeline degree, nor 2 chunks of 2 stages, divides them), 6 query heads on 2 K/V
heads (GQA: at tp 2 each rank holds one K/V head), tied embedding and head, sequence 10
(cp 2's zigzag cuts 4 chunks of 2.5: padded), weight decay, gradient clipping that binds, and 2
micro-batches of accumulation. Each layout trains 2 steps; losses and `full_state_dict()` equal
`tinyscale.reference.train` in float64 at rtol 1e-10 (reduction order differs: ~1e-15 per op).

The features rotate over the layouts (`matrix()`), so that each one meets every axis in the
default subset without a full cross product: ZeRO stages 0-3, SP on every tp > 1 layout but two,
activation checkpointing policies, the schedules, and dropout (counter masks) on every other
layout. Half the layouts give the GPT linear biases (GPTConfig.bias, `BIASED`): tp with and without
SP (a row-parallel bias is added once, after the reduction), cp, pp with virtual stages and zb_h1,
dp, ZeRO 0-3; a bias bug no layer test sees fails here. Layouts of one world size run in one pooled multi-rank call,
which also returns each rank's memory report (`test_layout_memory.py` checks it: no second run of the same layouts).
Default: the layouts on at most 4 ranks; `--thorough`: all of them.
Run: `pytest tests/engine/test_layout_matrix.py` (key layout_matrix).
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest
import torch

import tinyscale as ts
from tinyscale.config import ConfigError
from tinyscale.data import synthetic_token_batches
from tinyscale.engine.layout_memory import CATEGORIES
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks

VOCAB, SEQ, STEPS, MICRO, ROWS, N_LAYER = 61, 10, 2, 2, 1, 5
CLIP = 0.3  # the gradient norm of this model here is ~1-2: every step clips
DROPOUT = 0.1  # counter masks (GPTConfig.dropout_masks="counter"): one process's masks in every layout
# The matrix() indices whose GPT has biases: tp 2; cp 2 x tp 2 + SP; pp 2 x tp 2 + SP, interleaved;
# pp 2 x cp 2, zb_h1; dp 2 x tp 2; dp 2 x pp 2, ZeRO 3; dp 3; and (--thorough) afab, 16 ranks, pp 3 x tp 2.
BIASED = (1, 3, 5, 6, 7, 9, 12, 15, 16, 20)
POLICIES = ("none", "full", "selective", "every_k")
SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1", "afab")


def gpt(dropout: float = 0.0, bias: bool = False) -> GPT:
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=N_LAYER, n_head=6, n_kv_head=2, d_model=12,
                    ffn_hidden=20, tie_embeddings=True, dropout=dropout, dropout_masks="counter", bias=bias)
    return nonzero_biases(GPT(cfg, seed=7, dtype=torch.float64)) if bias else GPT(cfg, seed=7, dtype=torch.float64)


def nonzero_biases(model: GPT, seed: int = 11) -> GPT:
    """`model` with its linear biases drawn N(0, 0.02), in place: a model users bring has trained,
    nonzero biases (GPT-2's start at zero), so that a bias split with the wrong rows shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.empty(p.shape, dtype=torch.float64).normal_(0.0, 0.02, generator=gen))
    return model


def biased(layout: tuple) -> bool:
    """The layout's GPT has linear biases (`BIASED`)."""
    return layout in matrix() and matrix().index(layout) in BIASED


def model_of(layout: tuple) -> GPT:
    return gpt(layout[-1], bias=biased(layout))


@functools.cache
def matrix() -> tuple[tuple, ...]:
    """(dp, pp, cp, tp, zero stage, sp, policy, schedule, dropout) per layout, the features rotated."""
    degrees = list(itertools.product((1, 2), repeat=4))  # (2, 2, 2, 2): the 16-rank run, --thorough only
    # a degree of 3 (not tp: 2 K/V heads do not split over 3 ranks, nor copy evenly)
    degrees += [(3, 1, 1, 1), (1, 3, 1, 1), (1, 1, 3, 1), (3, 1, 1, 2), (1, 3, 1, 2)]
    out, pipelines = [], 0
    for i, (dp, pp, cp, tp) in enumerate(degrees):
        stage = (i + 3 * (i // 8)) % 4  # shifted after 8, so the pipelined layouts of <= 4 ranks meet stage 3
        sp = tp > 1 and i % 8 != 1  # tp 2 alone and dp 2 x tp 2 without SP, every other tp > 1 layout with it
        policy = POLICIES[(i + i // 4) % len(POLICIES)]  # shifted every 4, so not tied to the stage
        schedule = "1f1b"
        if pp > 1:  # the schedules in turn over the pipelined layouts
            schedule, pipelines = SCHEDULES[pipelines % len(SCHEDULES)], pipelines + 1
            if schedule == "interleaved_1f1b" and (MICRO % pp or 2 * pp > N_LAYER):
                schedule = "1f1b"  # it walks micro-batches in rounds of pp, 2 chunks of a block each
        dropout = DROPOUT if (i // 2 + i) % 2 == 0 else 0.0  # with and without tp, cp, pp alike
        out.append((dp, pp, cp, tp, stage, sp, policy, schedule, dropout))
    return tuple(out)


def lesson_table() -> str:
    """The matrix as lesson 12's table (`test_layout_matrix_lesson_table_is_the_matrix` keeps them equal)."""
    rows = ["| ranks | dp | pp | cp | tp | ZeRO | SP | checkpointing | schedule | dropout | bias | runs in |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lay in matrix():
        dp, pp, cp, tp, stage, sp, policy, schedule, dropout = lay
        rows.append(f"| {world(lay)} | {dp} | {pp} | {cp} | {tp} | {stage} | {'yes' if sp else ''} | {policy} | "
                    f"{schedule if pp > 1 else ''} | {dropout or ''} | {'yes' if biased(lay) else ''} | "
                    f"{'default' if world(lay) <= 4 else '--thorough'} |")
    return "\n".join(rows)


def test_layout_matrix_lesson_table_is_the_matrix():
    """lessons/12-engine.md shows this matrix: the table between its markers is `lesson_table()`."""
    lesson = (Path(__file__).parents[2] / "lessons" / "12-engine.md").read_text()
    start, end = "<!-- layout-matrix:start -->\n", "\n<!-- layout-matrix:end -->"
    assert start in lesson and end in lesson, "lesson 12 lost its layout-matrix markers"
    shown = lesson[lesson.index(start) + len(start):lesson.index(end)].strip()
    assert shown == lesson_table(), "lesson 12's table differs from matrix(): paste lesson_table() there"


def world(layout: tuple) -> int:
    dp, pp, cp, tp = layout[:4]
    return dp * pp * cp * tp


def config(layout: tuple) -> dict:
    dp, pp, cp, tp, stage, sp, policy, schedule, _ = layout
    parallel = {"tensor": tp, "pipeline": pp, "context": cp}
    if sp:
        parallel["sequence_parallel"] = True
    if pp > 1:
        parallel["pipeline_schedule"] = schedule
        if schedule == "interleaved_1f1b":
            parallel["virtual_stages"] = 2
    checkpointing = {"policy": policy} | ({"every_k": 2} if policy == "every_k" else {})
    return {"train_batch_size": ROWS * MICRO * dp, "train_micro_batch_size_per_gpu": ROWS,
            "gradient_accumulation_steps": MICRO, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage}, "activation_checkpointing": checkpointing,
            "parallel": parallel}


def batches(layout: tuple):
    return synthetic_token_batches(num_batches=STEPS, batch_size=ROWS * MICRO * layout[0], seq_len=SEQ,
                                   vocab_size=VOCAB, seed=9)


def _train(layouts: list[tuple]) -> list:
    out = []
    for layout in layouts:
        try:  # a refusal is raised on every rank alike before any collective: the next layout can run
            engine = ts.initialize(model_of(layout), config(layout))
        except ConfigError as exc:
            out.append(exc)
            continue
        losses = [engine.train_batch(b) for b in batches(layout)]
        report = engine.memory_report(when="before_step")  # test_layout_memory checks it against the formula
        out.append((losses, engine.full_state_dict(), {c: report.bytes(c) for c in CATEGORIES}))
    return out


@functools.cache
def results(world_size: int, thorough: bool) -> list:
    layouts = [lay for lay in selected(thorough) if world(lay) == world_size]
    return run_on_ranks(_train, world_size, layouts, timeout_s=600)


def selected(thorough: bool) -> list[tuple]:
    return [lay for lay in matrix() if thorough or world(lay) <= 4]


def _id(layout: tuple) -> str:
    dp, pp, cp, tp, stage, sp, policy, schedule, dropout = layout
    name = f"dp{dp}-pp{pp}-cp{cp}-tp{tp}-zero{stage}" + ("-sp" if sp else "") + f"-ac_{policy}" + \
        ("-dropout" if dropout else "") + ("-bias" if biased(layout) else "")
    return name + (f"-{schedule}" if pp > 1 else "")


@pytest.mark.parametrize("layout", [pytest.param(lay, id=_id(lay), marks=() if world(lay) <= 4 else pytest.mark.thorough)
                                    for lay in matrix()])  # more than 4 ranks: --thorough only
def test_layout_matrix_trains_like_single_process(layout, request):
    thorough = request.config.getoption("--thorough")
    model = model_of(layout)
    reference = config(layout) | {"parallel": {}, "zero_optimization": {"stage": 0},
                                  "activation_checkpointing": {"policy": "none"}}
    expected_losses = ts.reference.train(model, batches(layout), reference)
    expected = model.state_dict()
    index = [lay for lay in selected(thorough) if world(lay) == world(layout)].index(layout)
    for rank, rank_results in enumerate(results(world(layout), thorough)):
        if isinstance(rank_results[index], ConfigError):
            raise rank_results[index]
        losses, state, _ = rank_results[index]
        assert_losses_close(losses, expected_losses)
        assert list(state) == list(expected), f"rank {rank}: keys differ from the model's"
        assert_state_dicts_close(state, expected, what=f"{_id(layout)} rank {rank} after {STEPS} steps")
