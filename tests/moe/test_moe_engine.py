"""An MoE GPT trained by the engine with expert parallelism equals the single-process MoE.

The GPT: vocab 33, 3 layers with blocks 0 and 2 MoE (block 1 dense), 4 experts (6 tokens per
micro-batch: k * 6 / 4 assignments per expert, not a whole number), capacity factors that drop
assignments, top-1 and top-2, softmax and sigmoid routers, a shared expert, tied embeddings,
GQA, clipping, weight decay, 2 micro-batches per rank. Each layout's losses and
`full_state_dict()` equal `tinyscale.reference.train` in float64 at rtol 1e-10 on every rank
(sums of a few hundred float64 products reordered by the all-to-all: ~1e-15 relative; a token
sent to the wrong expert, a missed reduction or an aux loss without its gradient is off by
1e-3 or more). Layouts: ep 2 (world 2); ep 4 (ZeRO 1), dp 2 x ep 2 (ZeRO 0, 1 and 3), tp 2 x ep 2
and pp 2 x ep 2 (world 4, one pooled call); under --thorough also ZeRO 2, full and selective
activation checkpointing, the zb_h1 and AFAB schedules. Each rank stores only its E / ep experts:
its model states equal `layout_memory`'s count (`-k moe_engine_expert_parallel_memory`), and the
expert shards' gradients are the only traffic over their expert-data-parallel pair
(`-k edp_pair`). A checkpoint chain ep 4 -> 2 -> 1 -> 4 (ZeRO 1, 3, 2, 0) continues like one
process (`-k moe_engine_checkpoint`).
Refusals: `-k moe_engine_refuses`.
Run: `pytest tests/moe/test_moe_engine.py` (keys moe, expert_parallel).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import tinyscale as ts
from tinyscale.config import ConfigError, ZeroConfig
from tinyscale.data import synthetic_token_batches
from tinyscale.engine.layout_memory import CATEGORIES, rank_model_state_bytes
from tinyscale.engine.plan import LayoutPlan, placements
from tinyscale.models import GPT, GPTConfig
from tinyscale.moe import moe_layers, moe_stats
from tinyscale.testing import assert_every_rank_trained_like, run_on_ranks

VOCAB, SEQ, STEPS, M = 33, 6, 2, 2


def layout(*, world, dp=1, ep=1, tp=1, pp=1, stage=0, k=1, cf=1.0, router="softmax", shared=0, ac="none",
           schedule="1f1b") -> tuple:
    return tuple(sorted(locals().items()))


def gpt(spec: dict) -> GPT:
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=3, n_head=4, n_kv_head=2, d_model=8, ffn_hidden=12,
                    tie_embeddings=True, moe_experts=4, moe_top_k=spec["k"], moe_capacity_factor=spec["cf"],
                    moe_layers=(0, 2), moe_router=spec["router"], moe_shared_experts=spec["shared"],
                    moe_aux_loss_coef=0.05, moe_z_loss_coef=0.01)
    return GPT(cfg, seed=5, dtype=torch.float64)


def engine_config(spec: dict) -> dict:
    return {"train_batch_size": M * spec["dp"], "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": M,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}}, "gradient_clipping": 0.5,
            "zero_optimization": {"stage": spec["stage"]},
            "activation_checkpointing": {"policy": spec["ac"]},
            "parallel": {"expert": spec["ep"], "tensor": spec["tp"], "pipeline": spec["pp"]}
            | ({"pipeline_schedule": spec["schedule"]} if spec["pp"] > 1 else {})}


def batches(spec: dict):
    return synthetic_token_batches(num_batches=STEPS, batch_size=M * spec["dp"], seq_len=SEQ, vocab_size=VOCAB, seed=3)


def _train(layouts: list[tuple]):
    out = []
    for item in layouts:
        spec = dict(item)
        engine = ts.initialize(gpt(spec), engine_config(spec))
        losses = [engine.train_batch(b) for b in batches(spec)]
        assert engine.last_step["moe"]["assignments"] == len(moe_layers(engine.model)) * SEQ * spec["k"]
        report = engine.memory_report(when="before_step")
        out.append((losses, engine.full_state_dict(), engine.comm_ledger.calls("all_to_all"),
                    len(moe_layers(engine.model)), {c: report.bytes(c) for c in CATEGORIES},
                    _expert_traffic(engine)))
    return out


def _expert_traffic(engine) -> dict:
    """This rank's expert shards: elements held, and the ledger's gradient-reduction bytes over edp
    (groups of dp / ep ranks; none when that is 1) against those over dp."""
    from tinyscale.moe import expert_group_ranks
    held = sum(math.prod(s) for n, s in engine._tp_shapes.items() if ".experts." in n)
    rank = torch.distributed.get_rank()
    edp = next(tuple(g) for g in expert_group_ranks(engine.mesh.layout, engine.plan.ep)[1] if rank in g)
    rows = [r for r in engine.comm_ledger.rows if r.op in ("all_reduce", "reduce_scatter")]
    return {"held": held, "edp_bytes": sum(r.bytes for r in rows if len(edp) > 1 and r.ranks == edp)}


@functools.cache
def results(world: int, layouts: tuple) -> list:
    return run_on_ranks(_train, world, list(layouts), timeout_s=300)


def reference(spec: dict):
    model = gpt(spec)
    flat = engine_config(spec | {"dp": 1, "stage": 0, "ac": "none"}) | {"parallel": {}}
    flat |= {"train_batch_size": M * spec["dp"], "gradient_accumulation_steps": M * spec["dp"]}
    losses = ts.reference.train(model, batches(spec), flat)
    return losses, model.state_dict(), moe_stats(model)


WORLD2 = [layout(world=2, dp=2, ep=2, k=1, cf=0.7)]
WORLD4 = [
    layout(world=4, dp=4, ep=4, k=2, cf=0.8, stage=1),                        # ep 4
    layout(world=4, dp=4, ep=2, k=2, cf=0.9, router="sigmoid", shared=1),     # dp 2 x ep 2
    layout(world=4, dp=4, ep=2, k=1, cf=0.7, stage=3),                        # dp 2 x ep 2, ZeRO 3
    layout(world=4, dp=2, ep=2, tp=2, k=2, cf=0.8),                           # tp 2 x ep 2
    layout(world=4, dp=2, ep=2, pp=2, k=1, cf=0.7),                           # pp 2 x ep 2
    layout(world=4, dp=4, ep=2, k=2, cf=0.8, stage=1),                        # dp 2 x ep 2, ZeRO 1
]
IDS = ["ep4-zero1-top2", "dp2xep2-sigmoid-shared", "dp2xep2-zero3-top1", "tp2xep2-top2", "pp2xep2-top1",
       "dp2xep2-zero1-top2"]


def _check(world: int, layouts: list[tuple], index: int) -> None:
    spec = dict(layouts[index])
    losses, state, stats = reference(spec)
    assert stats["dropped"] > 0, "the capacity factor is chosen to drop assignments"
    ranks = [r[index] for r in results(world, tuple(layouts))]
    # this rank's MoE layers x micro-batches x (counts + rows out and back, forward and backward): 5 each,
    # and the forward's 3 again when a full checkpoint recomputes the block in backward; 5 under zb_h1 too,
    # on every stage: W starts at the weights' nodes, below the all-to-alls B ran (pipeline/split_backward.py)
    calls = 5 + (3 if spec["ac"] == "full" else 0)
    counts = [r[2] / (r[3] * M * STEPS) if r[3] else 0 for r in ranks]
    assert counts == [calls] * len(ranks), "every MoE layer went through the all-to-all, each once"
    assert_every_rank_trained_like([r[:2] for r in ranks], losses, state,
                                   what=f"{spec} full_state_dict after {STEPS} steps")


def test_moe_engine_expert_parallel_2_equals_one_process():
    _check(2, WORLD2, 0)


@pytest.mark.parametrize("index", range(len(WORLD4)), ids=IDS)
def test_moe_engine_expert_parallel_layouts_equal_one_process(index):
    _check(4, WORLD4, index)


def _plan(spec: dict) -> LayoutPlan:
    return LayoutPlan(world_size=spec["world"], dp=spec["dp"], pp=spec["pp"], cp=1, tp=spec["tp"],
                      zero=ZeroConfig(stage=spec["stage"]), ep=spec["ep"], moe=True)


@pytest.mark.parametrize("world,layouts,index", [(2, WORLD2, 0), (4, WORLD4, 2), (4, WORLD4, 5)],
                         ids=["ep2-zero0", "dp2xep2-zero3", "dp2xep2-zero1"])
def test_moe_engine_expert_parallel_memory_equals_layout_memory(world, layouts, index):
    """Each rank's memory_report(before_step) model states == `layout_memory`'s count, which holds
    E / ep experts per rank, sharded over the dp / ep ranks of its edp group under ZeRO (ep 2 at
    stage 0; dp 2 x ep 2 at ZeRO 1 and 3)."""
    spec = dict(layouts[index])
    expected = rank_model_state_bytes(gpt(spec).config, _plan(spec), dtype_bytes=8)
    replicated = rank_model_state_bytes(gpt(spec).config, _plan(spec | {"ep": 1}), dtype_bytes=8)
    for rank, r in enumerate(results(world, tuple(layouts))):
        assert r[index][4] == expected[rank], f"rank {rank}"
        if spec["stage"] < 3:  # not vacuous: the replicated layout holds every expert's parameters
            assert r[index][4]["parameters"] < replicated[rank]["parameters"]
        else:  # ZeRO-3 sharded them over dp already: E X / dp = (E / ep) X / (dp / ep) per rank
            assert r[index][4]["parameters"] == replicated[rank]["parameters"]


@pytest.mark.parametrize("index", [1, 5], ids=["dp2xep2-zero0", "dp2xep2-zero1"])
def test_moe_engine_expert_parallel_reduces_expert_shards_over_the_edp_pair(index):
    """dp 4 x ep 2: each rank stores 2 of the 4 experts (2 MoE layers x 3 tensors x 2 x 8 x 12
    elements), and the only reduction over its expert-data-parallel pair is of those shards' gradients,
    once per step: DDP's all-reduce or ZeRO 1's reduce-scatter of them (their units divide evenly)."""
    spec = dict(WORLD4[index])
    for r in results(4, tuple(WORLD4)):
        traffic = r[index][5]
        assert traffic["held"] == 2 * 3 * 2 * 8 * 12
        assert traffic["edp_bytes"] == STEPS * traffic["held"] * 8, spec  # float64


def test_moe_engine_expert_parallel_planner_counts_e_over_ep_experts():
    """The planner's model-state bytes (layout_memory of its Layout's plan) know an MoE GPT: at ep 2
    a rank holds 2 of the 4 experts of each MoE block, so (fp16 parameters, 2 bytes) its parameter
    bytes fall by 2 experts x 3 tensors x C x F_e x 2 MoE blocks x 2 bytes, at ZeRO 0 and 1."""
    from tinyscale.planner.estimate import Layout, model_state_bytes
    cfg = gpt(dict(layout(world=4))).config
    saved = 2 * 3 * cfg.d_model * cfg.expert_dim * 2 * 2
    for stage in (0, 1):
        one, two = (model_state_bytes(cfg, Layout(dp=4, ep=ep, zero_stage=stage)) for ep in (1, 2))
        assert all(one[r]["parameters"] - two[r]["parameters"] == saved for r in range(4))
    assert Layout(dp=4, ep=2).config(8)["parallel"]["expert"] == 2


# --thorough: ZeRO 2, activation checkpointing (the aux losses through recomputed blocks, the
# all-to-all rerun), the other pipeline schedules, pp x tp x ep, ZeRO 3 under a pipeline.
THOROUGH = [
    layout(world=4, dp=4, ep=4, k=2, cf=0.8, stage=2, router="sigmoid"),
    layout(world=4, dp=4, ep=2, k=2, cf=0.8, ac="full"),
    layout(world=4, dp=2, ep=2, tp=2, k=1, cf=0.7, ac="selective", stage=1),
    layout(world=4, dp=2, ep=2, pp=2, k=2, cf=0.8, schedule="zb_h1", stage=1),
    layout(world=4, dp=2, ep=2, pp=2, k=1, cf=0.7, schedule="afab", ac="full", shared=1),
    layout(world=4, dp=4, ep=2, k=1, cf=0.7, stage=2, router="sigmoid"),     # ZeRO 2 over an edp pair
    layout(world=4, dp=2, ep=2, pp=2, k=2, cf=0.8, stage=3),                 # ZeRO 3 under a pipeline
]


@pytest.mark.thorough
@pytest.mark.parametrize("index", range(len(THOROUGH)))
def test_moe_engine_expert_parallel_more_layouts_equal_one_process(index):
    _check(4, THOROUGH, index)


@pytest.mark.parametrize("parallel,model_changes,match", [
    ({"expert": 2}, {"moe_experts": 0}, "parallel.expert=2: expert parallelism splits"),
    ({"expert": 4, "tensor": 2}, {}, "must divide the data-parallel size 2"),
    ({"expert": 2}, {"moe_experts": 3}, "must divide GPTConfig.moe_experts=3"),
    ({"context": 2}, {}, "parallel.context=2 with an MoE GPT"),
    ({"tensor": 2, "sequence_parallel": True}, {}, "sequence_parallel with an MoE GPT"),
    ({}, {"reentrant": True}, "use_reentrant=true with an MoE GPT"),
    ({"expert": 2}, {"onebit": True}, "onebit_adam\" with parallel.expert=2"),
])
def test_moe_engine_refuses_layouts_that_cannot_equal_one_process(parallel, model_changes, match):
    from tinyscale.engine.plan import plan_layout
    spec = dict(layout(world=4))
    reentrant = model_changes.pop("reentrant", False)
    onebit = model_changes.pop("onebit", False)
    model = GPT(gpt(spec).config.with_(**model_changes))
    config = ts.EngineConfig.load({"train_batch_size": 4, "parallel": parallel} | (
        {"activation_checkpointing": {"policy": "full", "use_reentrant": True}} if reentrant else {}) | (
        {"compression": {"type": "onebit_adam"}, "optimizer": {"type": "AdamW"}} if onebit else {}))
    with pytest.raises(ConfigError, match=match):
        plan_layout(config, model, 4)


def _save_then_load(path: str, save: tuple, load: tuple):
    """Train one step in layout `save`, save, load into layout `load` (same world), train the second step."""
    first, second = batches(dict(save))
    engine = ts.initialize(gpt(dict(save)), engine_config(dict(save)))
    engine.train_batch(first)
    engine.save_checkpoint(path)
    engine = ts.initialize(gpt(dict(load) | {"k": dict(save)["k"]}), engine_config(dict(load)))
    engine.load_checkpoint(path)
    return engine.train_batch(second), engine.full_state_dict()


def _chain(path: str, layouts: list[tuple]):
    """One step in each layout, saving after it and loading into the next (same world)."""
    steps = synthetic_token_batches(num_batches=len(layouts), batch_size=M * 4, seq_len=SEQ, vocab_size=VOCAB,
                                    seed=3)
    losses = []
    for i, (lay, batch) in enumerate(zip(layouts, steps)):
        engine = ts.initialize(gpt(dict(lay)), engine_config(dict(lay)))
        if i:
            engine.load_checkpoint(path)
        losses.append(engine.train_batch(batch))
        engine.save_checkpoint(path)
        ep, rank = dict(lay)["ep"], torch.distributed.get_rank()
        experts = {n: p for n, p in placements(engine).items() if ".experts." in n}
        assert {p.local_shape[0] for p in experts.values()} == {4 // ep}  # (ZeRO-3 empties .data between uses)
        assert {p.ep_range for p in experts.values()} == ({(rank % ep * 4 // ep, (rank % ep + 1) * 4 // ep)}
                                                          if ep > 1 else {None})
    return losses, engine.full_state_dict()


def test_moe_engine_checkpoint_reshards_ep4_ep2_ep1_ep4():
    """Experts stored E / ep per rank, checkpointed by their boxes: a run saved and resumed at ep 4
    (ZeRO 1) -> ep 2 (ZeRO 3) -> ep 1 (ZeRO 2) -> ep 4 (ZeRO 0, saving too), one step each on dp 4,
    equals the uninterrupted single process in float64 (rtol 1e-10, as above)."""
    chain = [layout(world=4, dp=4, ep=e, k=2, cf=0.8, stage=z) for e, z in ((4, 1), (2, 3), (1, 2), (4, 0))]
    spec = dict(chain[0])
    model = gpt(spec)
    flat = engine_config(spec | {"stage": 0}) | {"parallel": {}, "gradient_accumulation_steps": M * 4}
    steps = synthetic_token_batches(num_batches=len(chain), batch_size=M * 4, seq_len=SEQ, vocab_size=VOCAB, seed=3)
    losses = ts.reference.train(model, steps, flat)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = run_on_ranks(_chain, 4, tmp + "/ckpt", chain, timeout_s=300)
    assert_every_rank_trained_like(out, losses, model.state_dict(), what="ep 4 -> 2 -> 1 -> 4 through checkpoints")


@pytest.mark.parametrize("save_ep,load_ep", [pytest.param(4, 2, marks=pytest.mark.thorough),
                                             pytest.param(1, 4, marks=pytest.mark.thorough)])
def test_moe_engine_checkpoint_reshards_across_expert_parallel_degrees(tmp_path, save_ep, load_ep):
    save = layout(world=4, dp=4, ep=save_ep, k=2, cf=0.8, stage=1)
    load = layout(world=4, dp=4, ep=load_ep, k=2, cf=0.8, stage=0)
    losses, state, _ = reference(dict(save))
    out = run_on_ranks(_save_then_load, 4, str(tmp_path / "ckpt"), save, load, timeout_s=300)
    assert_every_rank_trained_like([([losses[0], r[0]], r[1]) for r in out], losses, state,
                                   what=f"saved at ep {save_ep}, resumed at ep {load_ep}")
