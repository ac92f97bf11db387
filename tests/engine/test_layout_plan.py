"""The layout plan (`tinyscale.engine.plan`): refusals found in one pass, and parameter placements
that count every element of the model exactly once, in every layout.

- `plan_layout` lists every problem of a config in ONE ConfigError (the config's own and each
  axis's with the model and world), and describes what each axis does;
- in each layout (tp, tp + SP, dp x tp at ZeRO 3, pp with a tied table, pp x tp at ZeRO 1, cp at
  ZeRO 2, dp x cp x ... on 2 and 4 ranks): the elements each rank counts, summed over the world,
  are the model's size (at ZeRO stage 0: over one dp replica); every tp shard's range tiles its
  dimension; and the clipping norm's squares (`engine/grad_norm.py`: the counted gradients,
  summed over its groups) are the single-process gradient's squared norm (float64, first step,
  rtol 1e-10).
Run: `pytest tests/engine/test_layout_plan.py` (key layout_plan).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.config import ConfigError, EngineConfig
from tinyscale.data import synthetic_token_batches
from tinyscale.engine.grad_norm import GradNorm
from tinyscale.engine.plan import Placement, placements, plan_layout
from tinyscale.models import GPT, GPTConfig

VOCAB, SEQ = 61, 8  # a vocab no tp degree divides: the head and embedding carry padding rows


def gpt(tied: bool = True) -> GPT:
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=3, n_head=4, n_kv_head=2, d_model=16,
                    ffn_hidden=20, tie_embeddings=tied)
    return GPT(cfg, seed=11, dtype=torch.float64)


def config(dp: int, *, tp=1, pp=1, cp=1, stage=0, sp=False, m=2) -> dict:
    parallel = {"tensor": tp, "pipeline": pp, "context": cp} | ({"sequence_parallel": True} if sp else {})
    return {"train_batch_size": 2 * m * dp, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": m,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage},
            "parallel": parallel}


# (name, world, dp, config keywords, tied)
LAYOUTS = [
    ("tp2", 2, 1, dict(tp=2), True),
    ("tp2-sp-zero1", 2, 1, dict(tp=2, sp=True, stage=1), True),
    ("pp2-tied", 2, 1, dict(pp=2), True),
    ("cp2-zero2", 2, 1, dict(cp=2, stage=2), False),
    ("dp2-tp2-zero3", 4, 2, dict(tp=2, stage=3), True),
    ("pp2-tp2-zero1", 4, 1, dict(pp=2, tp=2, stage=1), True),
    ("dp2-cp2-zero1", 4, 2, dict(cp=2, stage=1), True),
    ("tp4-kv-copies", 4, 1, dict(tp=4), False),  # 2 K/V heads on 4 TP ranks: each head copied twice
    ("dp2-tp2-zero0", 4, 2, dict(tp=2), True),  # dp replicas of the gradients: summed over tp only
]


def test_layout_plan_lists_every_problem_at_once():
    """A config wrong on two axes gets both problems, each naming its field, in one error."""
    cfg = EngineConfig.load(config(1, tp=3, cp=2) | {"parallel": {"tensor": 3, "context": 2,
                                                                  "context_algorithm": "ulysses"}})
    with pytest.raises(ConfigError) as err:
        plan_layout(cfg, gpt(), world_size=4)
    message = str(err.value)
    assert "2 problems" in message
    assert "parallel.context=2" in message and "parallel.tensor=3" in message


def test_layout_plan_describes_each_axis():
    plan = plan_layout(EngineConfig.load(config(2, tp=2, stage=3)), gpt(), world_size=4)
    assert (plan.dp, plan.tp, plan.pp, plan.cp) == (2, 2, 1, 1)
    assert set(plan.axis_jobs()) == {"dp", "tp"}
    assert "parameters, gradients and states sharded over dp" in plan.axis_jobs()["dp"]
    assert plan.describe() == "4 ranks = pp 1 x dp 2 x cp 1 x tp 2, ZeRO stage 3"


def test_layout_plan_counted_elements_skip_padding_and_copies():
    """Pure arithmetic: a padded last vocab shard counts its real rows only; a second copy nothing."""
    padded = Placement(name="embed.weight", global_shape=(61, 16), local_shape=(31, 16), tp="shard", tp_dim=0,
                       tp_range=(31, 61))
    assert padded.counted_elements == 30 * 16
    sharded = Placement(name="embed.weight", global_shape=(61, 16), local_shape=(31, 16), tp="shard", tp_dim=0,
                        tp_range=(31, 61), zero_sharded=True, zero_ranges=((0, 8), (400, 496)))
    assert sharded.counted_elements == 8 + 80  # the second range stops at the 480 real elements
    copy = Placement(name="wk", global_shape=(8, 16), local_shape=(4, 16), tp="kv_copy", tp_counted=False)
    assert copy.counted_elements == 0


def _measure(layouts):
    """On each rank, per layout: placements, and the counted gradient squares at the first step."""
    out = []
    for _name, _world, dp, kw, tied in layouts:
        engine = ts.initialize(gpt(tied), config(dp, **kw))
        captured = []
        opt = engine._torch_optimizer()
        step = opt.step

        def capture(*args, _step=step, _engine=engine, **kwargs):  # gradients reduced, not yet applied
            norm = GradNorm(_engine)  # the clipping norm's own sum: the counted squares over its groups
            squares = norm.shard_squares() if _engine.zero is not None else \
                norm.squares((p, p.grad) for p in _engine.params)
            captured.append(norm.norm(squares).item() ** 2)
            return _step(*args, **kwargs)

        opt.step = capture
        batch = synthetic_token_batches(num_batches=1, batch_size=engine.batch.train_batch_size, seq_len=SEQ,
                                        vocab_size=VOCAB, seed=4)[0]
        table = placements(engine)
        engine.train_batch(batch)
        out.append(({k: (v.counted_elements, v.tp, v.tp_dim, v.tp_range, v.global_shape) for k, v in table.items()},
                    captured, dist.get_rank()))
    return out


@functools.cache
def measured(world: int) -> list:
    return ts.testing.run_on_ranks(_measure, world, [lay for lay in LAYOUTS if lay[1] == world])


def reference_squares(tied: bool, rows: int) -> float:
    model = gpt(tied)
    ids, targets = synthetic_token_batches(num_batches=1, batch_size=rows, seq_len=SEQ, vocab_size=VOCAB,
                                           seed=4)[0]
    model(ids, targets).backward()
    return sum(p.grad.pow(2).sum().item() for p in model.parameters())


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[lay[0] for lay in LAYOUTS])
def test_layout_plan_counts_every_parameter_once(index):
    name, world, dp, kw, tied = LAYOUTS[index]
    per_rank = [results[[lay for lay in LAYOUTS if lay[1] == world].index(LAYOUTS[index])]
                for results in measured(world)]
    model = gpt(tied)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    counted = {n: sum(tables[n][0] for tables, _, _ in per_rank if n in tables) for n in sizes}
    if kw.get("stage", 0) == 0 and dp > 1:  # each dp replica counts its copy: the norm sums over pp x tp only
        counted = {n: c // dp for n, c in counted.items()}
    assert counted == sizes, f"{name}: elements counted over one replica != the model's"
    for n, p in model.named_parameters():  # the shards' ranges tile their dimension (copies: each head once)
        ranges = sorted({tables[n][3] for tables, _, _ in per_rank if n in tables and tables[n][1] != "replicate"})
        if ranges:
            dim = next(tables[n][2] for tables, _, _ in per_rank if n in tables)
            assert ranges[0][0] == 0 and ranges[-1][1] == p.shape[dim], f"{name}: {n} ranges {ranges}"
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), f"{name}: {n} ranges {ranges}"
    expected = reference_squares(tied, 2 * 2 * dp)
    for _, captured, rank in per_rank:
        assert len(captured) == 1
        assert math.isclose(captured[0], expected, rel_tol=1e-10), f"{name} rank {rank}: {captured[0]} != {expected}"
