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

import ast
import functools
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
import tinyscale.engine
from tinyscale.config import ConfigError, EngineConfig, ZeroConfig
from tinyscale.data import synthetic_token_batches
from tinyscale.engine.grad_norm import GradNorm
from tinyscale.engine.plan import LayoutPlan, Placement, placements, plan_layout
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import assert_losses_close, assert_state_dicts_close
from tests.tensor_parallel.hf_models import READOUT_PLAN, Readout

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


def test_layout_plan_zero_stage_has_one_source_the_zero_section():
    """`plan.zero_stage` is `plan.zero.stage`: the engine's plan, the planner's and one built by hand
    cannot carry two stages (the planner's plans had zero_stage 3 beside a default section at stage 0),
    and plans that differ in the stage differ as the planner's cache keys."""
    from tinyscale.planner.estimate import Layout

    cfg = EngineConfig.load(config(2, stage=2))
    plan = plan_layout(cfg, gpt(), world_size=2)
    assert plan.zero_stage == plan.zero.stage == 2 and plan.zero == cfg.zero_optimization
    for stage in range(4):
        planned = Layout(dp=2, zero_stage=stage).plan()
        assert planned.zero_stage == planned.zero.stage == stage
        assert planned.describe().endswith(f"ZeRO stage {stage}")
    plans = {Layout(dp=2, zero_stage=stage).plan() for stage in (0, 1, 1, 3)}
    assert len(plans) == 3  # hashed by the section: equal stages one key, different stages different keys
    by_hand = LayoutPlan(2, 2, 1, 1, 1, zero=ZeroConfig(stage=3))
    assert by_hand.zero_stage == 3 and "parameters, gradients and states" in by_hand.axis_jobs()["dp"]
    with pytest.raises(TypeError, match="zero_stage"):  # the second field is gone: nothing to disagree
        LayoutPlan(2, 2, 1, 1, 1, zero_stage=1)
    with pytest.raises(TypeError, match=r"LayoutPlan.zero=.*ZeroConfig\(stage=1\)"):
        LayoutPlan(2, 2, 1, 1, 1, zero=1)


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


# ---------------------------------------------------------------------------------------------
# A layout is decided once: after `plan_layout` nothing reads the config's parallel or
# zero_optimization section; the transforms and the engine read the plan.

ENGINE_DIR = Path(tinyscale.engine.__file__).parent
LAYOUT_SECTIONS = ("parallel", "zero_optimization")
# The validators: what plan_layout calls (and plan_layout itself), the only readers of those sections.
VALIDATORS = {("compression.py", "check_config"), ("context.py", "check_config"), ("context.py", "check_layout"),
              ("compiled.py", "check_layout"), ("expert.py", "check_layout"), ("parallelize.py", "check_config"),
              ("parallelize.py", "check_tensor_layout"), ("parallelize.py", "check_autotp"),
              ("pipeline_layout.py", "config_problems"), ("pipeline_layout.py", "check_layout"),
              ("plan.py", "plan_layout")}


def layout_reads(source: str) -> list[tuple[str, int]]:
    """(enclosing function, line) of every `<...config>.parallel` or `.zero_optimization` in `source`:
    the attribute read on a name ending in "config" or on an attribute named config (engine.config)."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Attribute) and node.attr in LAYOUT_SECTIONS and (
                (isinstance(node.value, ast.Name) and node.value.id.endswith("config"))
                or (isinstance(node.value, ast.Attribute) and node.value.attr == "config")):
            found.append((function, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, function)
    visit(ast.parse(source), "<module>")
    return found


def test_layout_plan_only_the_validators_read_the_layout_sections():
    """No module under engine/ reads config.parallel or config.zero_optimization outside the
    validators that plan_layout runs: the transforms and the engine read the plan."""
    readers = {(path.name, function): line for path in sorted(ENGINE_DIR.glob("*.py"))
               for function, line in layout_reads(path.read_text())}
    assert ("plan.py", "plan_layout") in readers, "the scan finds nothing: it no longer sees plan_layout's reads"
    outside = {f"{name}:{line} in {function}()" for (name, function), line in readers.items()
               if (name, function) not in VALIDATORS}
    assert not outside, f"reads of the config's layout after plan_layout (read engine.plan instead): {sorted(outside)}"
    # the scan itself: an alias, an engine's config and a method's are all seen
    assert [f for f, _ in layout_reads("def f(config):\n  par = config.parallel\n"
                                       "def g(engine):\n  return engine.config.zero_optimization.stage\n"
                                       "class E:\n  def h(self):\n    return self.config.parallel.tensor\n")] == \
        ["f", "g", "h"]


class _Forgotten:
    """A config section read after plan_layout: any attribute read fails, naming it."""

    def __init__(self, section: str) -> None:
        object.__setattr__(self, "section", section)

    def __getattr__(self, name: str):
        raise AssertionError(f"config.{self.section}.{name} read after plan_layout: read engine.plan")


ODD = dict(vocab_size=VOCAB, max_seq_len=12, n_layer=5, n_head=6, n_kv_head=2, d_model=12, ffn_hidden=20,
           tie_embeddings=True)  # 5 layers, GQA, a vocab 2 does not divide, tied; T = 12 (cp 2 x tp 2 with SP)


def odd_model(kind: str) -> torch.nn.Module:
    """"counter" / "stream": the odd GPT with dropout 0.1 and those masks; "readout": a model of
    our own that AutoTP splits by parallel.tp_plan (tests/tensor_parallel/hf_models.py)."""
    if kind == "readout":
        return Readout()
    return GPT(GPTConfig(**ODD, dropout=0.1, dropout_masks=kind), seed=5, dtype=torch.float64)


def forgetting_config(dp: int, parallel: dict, stage: int, policy: str) -> dict:
    return {"train_batch_size": 2 * dp, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.3, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage}, "activation_checkpointing": {"policy": policy},
            "parallel": parallel}


# (name, dp, parallel, ZeRO stage, checkpointing policy, model): each setting the plan carries
# differs from its default somewhere
FORGETTING = [
    ("pp2-tp2-sp-interleaved-zero3-reshard", 1, {"pipeline": 2, "tensor": 2, "sequence_parallel": True,
     "pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2, "pipeline_reshard_after_forward": True},
     3, "full", "counter"),
    ("cp2-tp2-sp-contiguous-zero2", 1, {"context": 2, "tensor": 2, "sequence_parallel": True,
     "context_sharding": "contiguous"}, 2, "selective", "counter"),
    ("dp2-tp2-exact-stream-dropout-zero1", 2, {"tensor": 2}, 1, "none", "stream"),
    ("dp2-tp2-autotp-tp_plan-zero2", 2, {"tensor": 2, "tp_plan": READOUT_PLAN}, 2, "none", "readout"),
]
STREAM_SEED = 17
CHECKPOINTED = {"none": {"plain"}, "full": {"checkpointed"}, "selective": {"selective"}}


def _train_forgetting(runs: list[tuple]) -> list:
    """Each run's engine built from a config whose layout sections vanish once plan_layout returns."""
    from tinyscale.checkpointing.policies import policy_of  # noqa: PLC0415
    from tinyscale.engine import engine as engine_module, parallelize  # noqa: PLC0415

    real, find_plan, found = engine_module.plan_layout, parallelize.find_plan, []

    def plan_then_forget(config, *args, **kwargs):
        plan = real(config, *args, **kwargs)
        for section in LAYOUT_SECTIONS:
            object.__setattr__(config, section, _Forgotten(section))
        return plan
    out = []
    engine_module.plan_layout = plan_then_forget
    parallelize.find_plan = lambda *args, **kwargs: found.append(args) or find_plan(*args, **kwargs)
    try:
        for _, dp, parallel, stage, policy, kind in runs:
            found.clear()
            model = odd_model(kind)  # (its nn.Linear init draws from the global RNG)
            torch.manual_seed(STREAM_SEED)  # stream masks: one process's draws, from the same seed
            engine = ts.initialize(model, forgetting_config(dp, parallel, stage, policy))
            assert isinstance(engine.config.parallel, _Forgotten), "the config was not replaced"
            losses = [engine.train_batch(b) for b in synthetic_token_batches(
                num_batches=2, batch_size=2 * dp, seq_len=ODD["max_seq_len"], vocab_size=VOCAB, seed=6)]
            pipe, model = engine.pipeline, engine.model
            cp_state = getattr(model, "context_parallel", None)
            built = {"mesh": {a: engine.mesh.size(a) for a in ("pp", "dp", "cp", "tp")},
                     "stages here": len(pipe.stages) if pipe is not None else 1,
                     "sequence parallel": pipe.sequence_parallel if pipe is not None
                     else bool(getattr(model, "sequence_parallel", False)),
                     "cp sharding": pipe.cp_sharding if pipe is not None and pipe.cp_group is not None
                     else cp_state.sharding if cp_state is not None else None,
                     "zero": type(engine.zero).__name__ if engine.zero is not None else None,
                     "reshard after forward": pipe.stage3.reshard if pipe is not None and pipe.stage3 else None,
                     "checkpointing": set(policy_of(model)) - {"elsewhere"} if isinstance(model, GPT) else None,
                     "AutoTP plans found": len(found)}
            out.append((losses, engine.full_state_dict(), built))
    finally:
        engine_module.plan_layout, parallelize.find_plan = real, find_plan
    return out


@functools.cache
def forgetting_results() -> list:
    return ts.testing.run_on_ranks(_train_forgetting, 4, FORGETTING)


@pytest.mark.parametrize("index", range(len(FORGETTING)), ids=[run[0] for run in FORGETTING])
def test_layout_plan_engine_builds_and_trains_with_the_config_layout_gone(index):
    """After plan_layout the config's parallel and zero_optimization sections are replaced by
    objects that fail on any read: the engine still builds the layout the config asked for (mesh,
    virtual stages, SP, cp sharding, ZeRO class, stage 3's resharding, checkpointing) and trains
    it exactly like one process (float64, losses and final weights at rtol 1e-10)."""
    name, dp, parallel, stage, policy, kind = FORGETTING[index]
    model = odd_model(kind)
    reference = forgetting_config(dp, {}, 0, "none")
    torch.manual_seed(STREAM_SEED)
    expected_losses = ts.reference.train(model, synthetic_token_batches(
        num_batches=2, batch_size=2 * dp, seq_len=ODD["max_seq_len"], vocab_size=VOCAB, seed=6), reference)
    pp, cp, tp = (parallel.get(k, 1) for k in ("pipeline", "context", "tensor"))
    asked = {"mesh": {"pp": pp, "dp": dp, "cp": cp, "tp": tp},
             "stages here": parallel.get("virtual_stages", 1),
             "sequence parallel": parallel.get("sequence_parallel", False),
             "cp sharding": parallel.get("context_sharding", "zigzag") if cp > 1 else None,
             "zero": {0: None, 1: "ZeroStage1", 2: "ZeroStage2",
                      3: "ZeroStage3Manual" if pp > 1 else "ZeroStage3"}[stage],
             "reshard after forward": parallel.get("pipeline_reshard_after_forward", False) if pp > 1 and stage == 3
             else None,
             "checkpointing": CHECKPOINTED[policy] if kind != "readout" else None,
             "AutoTP plans found": int(kind == "readout")}  # once, by plan_layout's check; applied as found
    for rank, per_rank in enumerate(forgetting_results()):
        losses, state, built = per_rank[index]
        assert built == asked, f"{name} rank {rank}: built {built}, asked {asked}"
        assert_losses_close(losses, expected_losses)
        assert_state_dicts_close(state, model.state_dict(), what=f"{name} rank {rank}")


def test_layout_plan_autotp_plan_is_found_once_and_applied_as_found(monkeypatch):
    """AutoTP's plan is found by the check inside plan_layout, carried on the plan, and applied
    from it: one find_plan per engine (the plan below is what the transform applies)."""
    from tinyscale.engine import parallelize  # noqa: PLC0415

    calls = []
    real = parallelize.find_plan
    monkeypatch.setattr(parallelize, "find_plan", lambda *a, **k: calls.append(a) or real(*a, **k))
    cfg = EngineConfig.load(config(1, tp=2) | {"parallel": {"tensor": 2, "tp_plan": READOUT_PLAN}})
    plan = plan_layout(cfg, Readout(), world_size=2)
    assert len(calls) == 1
    assert dict(plan.autotp) == real(Readout(), 2, READOUT_PLAN) == READOUT_PLAN
    assert plan_layout(EngineConfig.load(config(1, tp=2)), gpt(), world_size=2).autotp == ()
