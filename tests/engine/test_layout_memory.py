"""Memory per rank in every layout: each rank's model-state bytes equal the pure formula, exactly.

For every layout of the layout matrix (`test_layout_matrix.py`: dp x pp x cp x tp with a ZeRO
stage, SP, activation checkpointing, a schedule; the odd GPT with vocab 61, 5 layers, GQA and a
tied table, linear biases in half the layouts), each rank's
`engine.memory_report(when="before_step")` of the second step (Adam's states exist), taken in the
matrix's own pooled run, gives parameters, gradients, master_weights and optimizer_states equal
(==) to `tinyscale.engine.layout_memory.rank_model_state_bytes` of the same plan: pipeline stages from
`partition_gpt`, TP shards with vocab padding, replicated norms, ZeRO's units with their
flat-buffer padding and Adam's step counter per fragment. Two layouts run again under fp16 and
bf16 (2-byte parameters and gradients, fp32 masters and states); a few more cover what the
matrix's GPT cannot: ZeRO groups that pad (its width 12 is divisible by every group it has), the
zero_optimization knobs that change the units, K/V heads copied over tp 4, and linear biases
(`BIASED`: column biases split, row-parallel ones whole on every TP rank); and, for the lesson's
table, two matrix layouts whose matrix GPT has biases again without (`PLAIN`). Pure tests: at
tp = pp = 1 the formula is `zero.estimate.model_state_bytes` with padding; over awkward shapes the ranks of
one model replica hold the model plus exactly its accounted copies and padding.
Default: the layouts on at most 4 ranks, one pooled call per world size; `--thorough`: all.
Run: `pytest tests/engine/test_layout_memory.py` (key layout_memory).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import tinyscale as ts
from tests.engine.test_layout_matrix import batches, biased, config, gpt, matrix, model_of, world
from tests.engine.test_layout_matrix import results as matrix_results
from tinyscale.engine.layout_memory import (
    CATEGORIES,
    rank_model_state_bytes,
    rank_param_counts,
    rank_tensors,
    zero_units,
)
from tinyscale.config import ZeroConfig
from tinyscale.engine.plan import LayoutPlan
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import run_on_ranks
from tinyscale.zero.estimate import model_state_bytes

# Mixed precision for two layouts (a float32 model: masters and Adam states in fp32). fp16 starts
# at a loss scale of 2^8, not 2^16, so that no step is skipped for overflow (a skipped first step
# would leave no Adam state to count).
MIXED = {((2, 1, 1, 2), "fp16"), ((1, 2, 1, 2), "bf16")}
# Every tensor of a GPT is a multiple of d_model elements, and the matrix's 12 is divisible by
# every ZeRO group it has (2, 3, 4): no flat buffer there is padded. These run a GPT of width 10
# (5 heads on 1 K/V head, 4 layers, an untied head) whose units groups of 3 and 4 must pad: dp 3
# at stages 1-3, dp 2 x cp 2 at stage 2, and (6 ranks, --thorough) dp 3 x pp 2 at stage 3, one
# unit per pipeline stage.
PADDED = [(3, 1, 1, 1, s, False, "none", "1f1b", 0.0) for s in (1, 2, 3)] + \
    [(2, 1, 2, 1, 2, False, "none", "1f1b", 0.0), (3, 2, 1, 1, 3, False, "none", "1f1b", 0.0)]
# K/V heads copied (tp 4 > 1 K/V head: each rank holds a copy of it) and a vocab of 61 padded to
# 64 over tp 4, on a GPT of width 8 with 4 query heads: ZeRO 2, and with dp 2 x tp 4 (--thorough) ZeRO 3.
KV_COPIES = [(1, 1, 1, 4, 2, False, "none", "1f1b", 0.0), (2, 1, 1, 4, 3, False, "none", "1f1b", 0.0)]
# Linear biases (GPTConfig.bias): a column bias split with its rows, a row-parallel one whole on
# every TP rank, a copied K/V head's bias copied: tp 2 + SP at ZeRO 1, pp 2 x tp 2 at ZeRO 2 on the
# matrix's GPT, and the K/V copies of tp 4 at ZeRO 3 on the width-8 one.
BIASED = [((1, 1, 1, 2, 1, True, "none", "1f1b", 0.0), "bias"), ((1, 2, 1, 2, 2, False, "none", "1f1b", 0.0), "bias"),
          ((1, 1, 1, 4, 3, False, "none", "1f1b", 0.0), "kv4-bias")]
# zero_optimization's knobs that change the units, on dp 3 of the width-10 GPT: buckets of at most
# 300 elements (stages 1 and 2: many units; under bf16 too, where a bucket's bytes are counted
# before the parameters are rounded) with sub-groups of 250 (fragments cut again), and stage 3
# with the 10-element norms persistent (whole on every rank, their own unit).
SMALL = (("reduce_bucket_size", 300), ("sub_group_size", 250))
KNOBS = [((3, 1, 1, 1, s, False, "none", "1f1b", 0.0), p, SMALL) for s, p in ((1, None), (2, None), (2, "bf16"))] + \
    [((3, 1, 1, 1, 3, False, "none", "1f1b", 0.0), None, (("stage3_param_persistence_threshold", 11),))]
# The matrix's tp 2 and cp 2 x tp 2 layouts on the GPT without biases (the matrix gives theirs
# biases): lesson 12's table shows them, and every row of it is measured here.
PLAIN = [lay for lay in matrix() if lay[:5] in ((1, 1, 1, 2, 1), (1, 1, 2, 2, 3))]


def _jobs(thorough: bool) -> list[tuple]:
    """(layout, precision, other model, zero_optimization overrides): every selected layout in
    float64, the MIXED ones again in fp16/bf16, then the PADDED layouts, the KNOBS, the KV_COPIES."""
    layouts = [lay for lay in matrix() if thorough or world(lay) <= 4]
    return [(lay, None, None, ()) for lay in layouts] + \
        [(lay, p, None, ()) for lay in layouts for d, p in sorted(MIXED) if lay[:4] == d] + \
        [(lay, None, "width10", ()) for lay in PADDED if thorough or world(lay) <= 4] + \
        [(lay, p, "width10", knobs) for lay, p, knobs in KNOBS] + \
        [(lay, None, "kv4", ()) for lay in KV_COPIES if thorough or world(lay) <= 4] + \
        [(lay, None, other, ()) for lay, other in BIASED] + \
        [(lay, None, "plain", ()) for lay in PLAIN if thorough or world(lay) <= 4]


def in_matrix_run(job: tuple) -> bool:
    """A matrix layout on the matrix's own GPT: its bytes come from `test_layout_matrix.results`."""
    layout, precision, other, knobs = job
    return layout in matrix() and precision is None and other is None and not knobs


def _engine_config(layout: tuple, precision: str | None, knobs: tuple = ()) -> dict:
    cfg = config(layout)
    cfg["zero_optimization"] = cfg["zero_optimization"] | dict(knobs)
    if precision == "fp16":
        return cfg | {"fp16": {"enabled": True, "initial_scale_power": 8}}
    return cfg | ({"bf16": {"enabled": True}} if precision == "bf16" else {})


def _model(layout: tuple, precision: str | None, other: str | None, knobs: tuple = ()) -> GPT:
    if in_matrix_run((layout, precision, other, knobs)):
        return model_of(layout)  # the matrix's GPT: biases where its BIASED says
    model = gpt(layout[-1], bias=other is not None and other.endswith("bias"))
    if other in ("kv4", "kv4-bias"):
        return GPT(model.config.with_(d_model=8, n_head=4, n_kv_head=1, ffn_hidden=16), seed=7, dtype=torch.float64)
    if other == "width10":
        cfg = model.config.with_(d_model=10, n_head=5, n_kv_head=1, ffn_hidden=14, n_layer=4, tie_embeddings=False)
        return GPT(cfg, seed=7, dtype=torch.float64 if precision is None else torch.float32)
    return model if precision is None else GPT(model.config, seed=7, dtype=torch.float32)


def _measure(jobs: list[tuple]) -> list[dict]:
    out = []
    for layout, precision, other, knobs in jobs:
        engine = ts.initialize(_model(layout, precision, other), _engine_config(layout, precision, knobs))
        for batch in batches(layout):
            engine.train_batch(batch)
        report = engine.memory_report(when="before_step")
        out.append({c: report.bytes(c) for c in CATEGORIES})
    return out


@functools.cache
def measured(world_size: int, thorough: bool) -> list:
    """[rank][job] -> bytes by category, for every job of one world size: the matrix's layouts from
    its pooled run, the others from one pooled call here."""
    jobs = [j for j in _jobs(thorough) if world(j[0]) == world_size]
    own = [j for j in jobs if not in_matrix_run(j)]
    here = run_on_ranks(_measure, world_size, own, timeout_s=600) if own else [[] for _ in range(world_size)]
    layouts = [lay for lay in matrix() if (thorough or world(lay) <= 4) and world(lay) == world_size]
    theirs = matrix_results(world_size, thorough)
    out = []
    for rank in range(world_size):
        row = []
        for job in jobs:
            if in_matrix_run(job):
                result = theirs[rank][layouts.index(job[0])]
                if isinstance(result, Exception):
                    raise result
                row.append(result[2])
            else:
                row.append(here[rank][own.index(job)])
        out.append(row)
    return out


def plan_of(layout: tuple) -> LayoutPlan:
    dp, pp, cp, tp, stage, sp, _, schedule, _ = layout
    return LayoutPlan(world_size=world(layout), dp=dp, pp=pp, cp=cp, tp=tp, schedule=schedule, sequence_parallel=sp,
                      virtual_stages=2 if pp > 1 and schedule == "interleaved_1f1b" else 1, zero=ZeroConfig(stage=stage))


def _id(job: tuple) -> str:
    (dp, pp, cp, tp, stage, sp, *_), precision, other, knobs = job
    return f"dp{dp}-pp{pp}-cp{cp}-tp{tp}-zero{stage}" + ("-sp" if sp else "") + (f"-{precision}" if precision else "") \
        + (f"-{other}" if other else "") + "".join(f"-{k.split('_')[-2]}{v}" for k, v in knobs)


@pytest.mark.parametrize("job", [pytest.param(j, id=_id(j), marks=() if world(j[0]) <= 4 else pytest.mark.thorough)
                                 for j in _jobs(True)])
def test_layout_memory_per_rank_equals_formula(job, request):
    thorough = request.config.getoption("--thorough")
    layout, precision, other, knobs = job
    size = world(layout)
    index = [j for j in _jobs(thorough) if world(j[0]) == size].index(job)
    dtype_bytes = 8 if precision is None else 4
    expected = rank_model_state_bytes(_model(*job).config, plan_of(layout), dtype_bytes=dtype_bytes,
                                      compute_bytes=None if precision is None else 2, **dict(knobs))
    if other == "width10" and not knobs:  # not vacuous: some unit of rank 0 is padded (the group does not divide it)
        n, cfg = layout[0] * layout[2], _model(*job).config
        units, _ = zero_units(rank_tensors(cfg, plan_of(layout), 0), layout[4], bucket_bytes=5e8 * 8, element_bytes=8,
                              pipeline=layout[1] > 1)
        assert any(sum(u) % n for u in units), units
    if knobs:  # not vacuous: the knobs change the formula's answer
        assert expected != rank_model_state_bytes(_model(*job).config, plan_of(layout), dtype_bytes=dtype_bytes,
                                                  compute_bytes=None if precision is None else 2)
    for rank, jobs in enumerate(measured(size, thorough)):
        assert jobs[index] == expected[rank], f"{_id(job)} rank {rank}"


# --- pure ---------------------------------------------------------------------------------------

def test_layout_memory_reduces_to_model_state_bytes():
    """tp = pp = 1: the paper's per-device model states (2 + 2 + 12 bytes, mixed-precision Adam)
    with Psi padded as the engine pads it, each unit to a multiple of N (stages 1-2: one unit,
    in reverse; stage 3: one per block, then the root), plus Adam's 4-byte step counter
    per tensor piece in the shard, minus the state padding does not have. N = 3 divides nothing here."""
    cfg = GPTConfig(vocab_size=61, max_seq_len=8, n_layer=3, n_head=4, n_kv_head=2, d_model=8, ffn_hidden=12,
                    tie_embeddings=True)
    sizes = [x.numel for x in rank_tensors(cfg, LayoutPlan(1, 1, 1, 1, 1), 0)]  # embed, 3 x 9 block tensors, norm
    psi = sum(sizes)
    assert psi == cfg.num_params() and len(sizes) == 29
    units = {1: [sizes[::-1]], 2: [sizes[::-1]], 3: [sizes[1 + 9 * i:10 + 9 * i] for i in range(3)] + [[sizes[0], sizes[-1]]]}
    for n in (1, 2, 3):
        for stage in (0, 1, 2, 3):
            padded = sum(n * math.ceil(sum(u) / n) for u in units.get(stage, [sizes]))
            paper = model_state_bytes(padded if stage else psi, n, stage)  # the sharded parts, padded
            whole = model_state_bytes(psi, 1, 0)  # what the stage leaves whole is unpadded
            shards = model_state_bytes(padded, n, 2)
            got = rank_model_state_bytes(cfg, LayoutPlan(n, n, 1, 1, 1, zero=ZeroConfig(stage=stage)), dtype_bytes=4,
                                         compute_bytes=2)
            for rank, states in got.items():
                real, pieces = psi, len(sizes)
                if stage:  # the elements and tensor pieces inside this rank's shard of each unit
                    real = pieces = 0
                    for unit in units[stage]:
                        s, start = math.ceil(sum(unit) / n), 0
                        for size in unit:
                            inside = max(0, min((rank + 1) * s, start + size) - max(rank * s, start))
                            real, pieces, start = real + inside, pieces + (inside > 0), start + size
                assert states == {
                    "parameters": (paper if stage == 3 else whole).device.parameters,
                    # stage 1: shards after its last backward (stage 2's), whole only between micro-batches
                    "gradients": (paper if stage >= 2 else shards if stage == 1 else whole).device.gradients,
                    "master_weights": paper.device.master_weights,
                    "optimizer_states": 8 * real + 4 * pieces}, (n, stage, rank)
                if rank < n - 1 or padded == psi:  # no padding on this rank: the paper's number exactly
                    assert states["optimizer_states"] - 4 * pieces == paper.device.optimizer_states, (n, stage, rank)


@settings(max_examples=60)  # pure arithmetic, ~1 ms an example: more than the suite's default 8
@given(vocab=st.integers(5, 70), layers=st.integers(1, 6), kv=st.sampled_from([1, 2, 4]), group=st.integers(1, 3),
       head_dim=st.sampled_from([2, 4]), ffn=st.integers(1, 3), tied=st.booleans(), tp=st.sampled_from([1, 2, 4]),
       pp=st.integers(1, 3), virtual=st.integers(1, 2), dp=st.integers(1, 3), stage=st.integers(0, 3),
       bias=st.booleans())
def test_layout_memory_one_replica_holds_the_model_and_its_copies(vocab, layers, kv, group, head_dim, ffn, tied, tp,
                                                                  pp, virtual, dp, stage, bias):
    """Summed over one replica's ranks (dp coordinate 0), the unpadded counts are the model's size plus
    the tied table's pipeline copy, the K/V heads' copies (tp > K, their biases too) and the
    replicated norms (and row-parallel biases); the
    padded counts add the vocab tables' padding rows; and ZeRO's shards over dp cover each unit's
    padded size exactly, padding on the last ranks only."""
    heads = kv * group * tp // math.gcd(kv * group, tp)  # a multiple of kv and of tp
    assume(pp * virtual <= layers)  # (kv and tp are powers of 2: one always divides the other)
    C = heads * head_dim
    cfg = GPTConfig(vocab_size=vocab, max_seq_len=8, n_layer=layers, n_head=heads, n_kv_head=kv, d_model=C,
                    ffn_hidden=ffn * tp * 2, tie_embeddings=tied, bias=bias)
    plan = LayoutPlan(dp * pp * tp, dp, pp, 1, tp, virtual_stages=virtual, zero=ZeroConfig(stage=stage))
    replica = [r for r in range(plan.world_size) if r % (dp * tp) < tp]  # dp coordinate 0
    tensors = [x for r in replica for x in rank_tensors(cfg, plan, r)]
    counts = rank_param_counts(cfg, plan)
    assert sum(counts[r] for r in replica) == sum(x.numel for x in tensors)
    assert all(counts[r] == counts[r % tp + (r // (dp * tp)) * dp * tp] for r in counts)  # dp replicas alike
    D, L = head_dim, layers
    tied_copy = vocab * C if tied and pp > 1 else 0
    kv_copies = 2 * L * (tp // kv - 1) * kv * D * (C + bias) if tp > kv else 0  # weight (D, C), bias (D,)
    norms = (tp - 1) * (2 * L + 1 + 2 * L * bias) * C  # two norms a block, the final norm; wo's, w_down's bias
    assert sum(x.real for x in tensors) == cfg.num_params() + tied_copy + kv_copies + norms
    tables = 1 + (not tied or pp > 1)
    assert sum(x.numel for x in tensors) - sum(x.real for x in tensors) == tables * (-(-vocab // tp) * tp - vocab) * C
    assert sum(x.real for x in tensors if x.kind not in ("replicated", "kv_copy", "tied_copy")) + \
        sum(x.real for x in tensors if x.kind == "replicated") // tp + \
        sum(x.real for x in tensors if x.kind == "kv_copy") * kv // tp == cfg.num_params()
    if stage:  # ZeRO over dp: the ranks' shards of each unit tile its padded buffer
        got = rank_model_state_bytes(cfg, plan, dtype_bytes=1, states_per_element=1, step_bytes=0)
        for r in replica:
            units, _ = zero_units(rank_tensors(cfg, plan, r), stage, bucket_bytes=5e8, element_bytes=1,
                                  pipeline=pp > 1)
            peers = [r + k * tp for k in range(dp)]
            assert sum(got[p]["master_weights"] for p in peers) == sum(dp * -(-sum(u) // dp) for u in units)
            assert sum(got[p]["optimizer_states"] for p in peers) == sum(map(sum, units))


# --- the lesson's table -------------------------------------------------------------------------

LESSON = "lessons/12-engine.md"
# (dp, pp, cp, tp, ZeRO stage, width-10 model?) of the layouts in the table: each also runs above,
# in float64, where every rank's measured bytes equal the formula's
TABLE = [(1, 2, 1, 1, 0, None), (1, 1, 1, 2, 1, "plain"), (1, 1, 2, 2, 3, "plain"), (3, 1, 1, 1, 2, "width10")]
TABLE_JOBS = [next(j for j in _jobs(False) if (*j[0][:5], j[2]) == row and j[1] is None and not j[3]) for row in TABLE]


def lesson_table() -> str:
    """The markdown table of lesson 12's "Memory per rank in every layout", from the formula;
    ranks with the same bytes share a row."""
    lines = ["| layout | ranks | parameters | gradients | master weights | optimizer states |",
             "|---|---|---|---|---|---|"]
    for job in TABLE_JOBS:
        layout = job[0]
        per_rank = rank_model_state_bytes(_model(*job).config, plan_of(layout), dtype_bytes=8)
        dp, pp, cp, tp, stage, sp, *_ = layout
        name = " x ".join(f"{a} {d}" for a, d in zip(("dp", "pp", "cp", "tp"), (dp, pp, cp, tp)) if d > 1) + \
            (" + SP" if sp else "") + f", ZeRO {stage}" + (" (width 10)" if job[2] == "width10" else "")
        rows: list[list] = []
        for rank, states in per_rank.items():
            if rows and rows[-1][1] == states:
                rows[-1][0].append(rank)
            else:
                rows.append([[rank], states])
        for ranks, states in rows:
            span = str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
            lines.append(f"| {name} | {span} | " + " | ".join(f"{states[c]:,}" for c in CATEGORIES) + " |")
    return "\n".join(lines)


def test_layout_memory_lesson_table_is_the_formula():
    assert len(PLAIN) == 2 and all(biased(lay) for lay in PLAIN)  # else the table's rows would run twice
    text = (Path(__file__).parents[2] / LESSON).read_text()
    assert lesson_table() in text, "regenerate the table: print(tests.engine.test_layout_memory.lesson_table())"
