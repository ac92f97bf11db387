"""The pipeline composes with every other axis and with ZeRO stages 1, 2 and 3.

Each layout trains the odd GPT (vocab 33 that tp does not divide, 3 or 5 layers the stages do
not divide, 4 query / 2 or 1 K/V heads, tied or not, sequence 6 that cp's zigzag pads to 8,
AdamW with weight decay or SGD with momentum, clipping, 2-4 micro-batches) for STEPS steps,
and its losses and `full_state_dict()` equal `tinyscale.reference.train` in float64 at rtol
1e-10 on every rank:

- pp 2 x tp 2 with sequence parallelism (stages pass (B, T/t, C) shards: the ledger's sends
  are 1/t of the full activation's bytes);
- pp 2 x cp 2 (ring zigzag, Ulysses contiguous; each stage's attention over cp, the loss's
  gradient scaled by cp so that the dp x cp mean sums over cp);
- dp 2 x pp 2 at ZeRO 1 and 2 with clipping (the norm summed over the stages, the tied
  table once), ZeRO 2 reduce-scattering once per step (the ledger: one call per bucket, of
  the padded local parameters' bytes, whatever the number of micro-batches);
- pp 2 x tp 2 at ZeRO 1 and 2 with clipping (the TP shards summed, replicated ones once);
- dp 2 x pp 2 at ZeRO 3 (1F1B, interleaved, zb_h1), each stage's parameters kept gathered
  while a micro-batch is in flight or gathered again for every pass: the ledger's all-gathers
  equal the formula per rank, one reduce-scatter per stage; a checkpoint written at ZeRO 3
  resumes in the other policy; a step raising on one rank only is dropped everywhere (its dp
  peer's all-gathers still matched) and the retry trains like one process;
- at 8 ranks: dp 2 x pp 2 x tp 2 (DDP, ZeRO 1, ZeRO 2, ZeRO 3, SP) and dp 2 x pp 2 x cp 2 (ZeRO 1, 3).
The layouts of one world size run in one pooled call (cached per module). More world-4
pairings and the 8-rank call run under --thorough only (the 8-rank pool alone takes ~25 s to
start on 2 cores, more than the default suite's share).
Run: `pytest tests/engine/test_engine_pipeline_compose.py` (keys engine_pipeline, layout_pp).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.config import ConfigError, EngineConfig
from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig
from tinyscale.pipeline.schedules import BW, SEND_B, SEND_F, B, F, W
from tinyscale.testing import (
    assert_every_rank_trained_like, assert_losses_close, assert_state_dicts_close, run_on_ranks,
)

VOCAB, SEQ, STEPS = 33, 6, 2
OPTIMIZERS = {  # SGD too: Adam hides a uniform gradient-scale bug (a missing or doubled reduction)
    "adamw": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}},
    "sgd": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}},
}
CLIP = 0.05  # the gradient norm here is ~1: every step clips


def layout(schedule="1f1b", *, dp=1, pp=2, tp=1, cp=1, sp=False, v=1, stage=0, clip=CLIP, tied=True, kv=2,
           n_layer=3, m=2, optimizer="sgd", algorithm="ring", sharding="zigzag", reshard=False) -> tuple:
    """One layout, hashable (the pooled call is cached by its layouts)."""
    return tuple(sorted(locals().items()))


def gpt(spec: dict, seed: int = 5) -> GPT:
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=spec["n_layer"], n_head=4, n_kv_head=spec["kv"],
                    d_model=8, ffn_hidden=12, tie_embeddings=spec["tied"])
    return GPT(cfg, seed=seed, dtype=torch.float64)


def engine_config(spec: dict) -> dict:
    parallel = {"pipeline": spec["pp"], "pipeline_schedule": spec["schedule"], "tensor": spec["tp"],
                "context": spec["cp"]}
    if spec["v"] > 1:
        parallel["virtual_stages"] = spec["v"]
    if spec["sp"]:
        parallel["sequence_parallel"] = True
    if spec["cp"] > 1:
        parallel |= {"context_algorithm": spec["algorithm"], "context_sharding": spec["sharding"]}
    if spec["reshard"]:
        parallel["pipeline_reshard_after_forward"] = True
    return {"train_batch_size": spec["m"] * spec["dp"], "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": spec["m"], "optimizer": OPTIMIZERS[spec["optimizer"]],
            "gradient_clipping": spec["clip"], "zero_optimization": {"stage": spec["stage"]}, "parallel": parallel}


def batches(spec: dict):
    return synthetic_token_batches(num_batches=STEPS, batch_size=spec["m"] * spec["dp"], seq_len=SEQ,
                                   vocab_size=VOCAB, seed=3)


def _train(layouts: list[tuple]):
    """On each rank: every layout trained STEPS steps; its losses, full state, the last step's
    p2p and reduce-scatter rows, what the schedule says this rank sends, and its local numel."""
    out = []
    for item in layouts:
        spec = dict(item)
        engine = ts.initialize(gpt(spec), engine_config(spec))
        losses = []
        for b in batches(spec):
            engine.comm_ledger.clear()
            losses.append(engine.train_batch(b))
        rows = [(row.op, row.bytes) for row in engine.comm_ledger.rows
                if row.op in ("isend", "irecv", "reduce_scatter", "all_gather")]
        sends = sum(a.kind in (SEND_F, SEND_B) for a in engine.pipeline.schedule[engine.pipeline.rank])
        if spec["stage"] == 3:  # the parameters are freed: their shapes are the flat units' (one per stage)
            units = [sum(shape.numel() for shape in fu.shapes) for fu in engine.zero.sharded.units]
        else:
            units = [sum(q.numel() for q in stage.parameters() if q.requires_grad)  # this rank's stages, in order
                     for _, stage in sorted(engine.pipeline.stages.items())]
        local = sum(units)
        compute = [(a.kind, a.stage) for a in engine.pipeline.schedule[engine.pipeline.rank] if a.kind in (F, B, BW, W)]
        memory = (engine.memory_report().bytes("parameters"), engine.memory_report("before_step").bytes("gradients"))
        out.append((losses, engine.full_state_dict(), rows, sends, local, dist.get_rank(engine.pipeline.group), units,
                    compute, memory))
    return out


@functools.cache
def results(world: int, layouts: tuple) -> list:
    return run_on_ranks(_train, world, list(layouts), timeout_s=300)


def reference(spec: dict):
    model = gpt(spec)
    flat = engine_config(spec | {"dp": 1, "m": spec["m"] * spec["dp"], "stage": 0}) | {"parallel": {}}
    return ts.reference.train(model, batches(spec), flat), model.state_dict()


def _check(world: int, layouts: list[tuple], index: int) -> None:
    spec = dict(layouts[index])
    expected_losses, expected = reference(spec)
    assert_every_rank_trained_like([r[index] for r in results(world, tuple(layouts))], expected_losses, expected,
                                   what=f"{spec} full_state_dict after {STEPS} steps")


def _ids(layouts):
    def name(spec):
        spec = dict(spec)
        parts = [spec["schedule"], f"dp{spec['dp']}", f"pp{spec['pp']}", f"tp{spec['tp']}", f"cp{spec['cp']}",
                 f"zero{spec['stage']}"]
        return "-".join(parts + (["sp"] if spec["sp"] else []) + ([spec["algorithm"]] if spec["cp"] > 1 else [])
                        + (["reshard"] if spec["reshard"] else []))
    return [name(s) for s in layouts]


# World 4: every pairing of the pipeline with one other axis or a ZeRO stage.
WORLD4 = [
    layout("1f1b", tp=2, sp=True, kv=1),
    layout("interleaved_1f1b", tp=2, sp=True, v=2, n_layer=5, clip=0.0, optimizer="adamw"),
    layout("zb_h1", tp=2, sp=True, stage=1, tied=False, m=3, optimizer="adamw"),
    layout("1f1b", cp=2, algorithm="ring", sharding="zigzag", clip=0.0),
    layout("interleaved_1f1b", cp=2, algorithm="ulysses", sharding="contiguous", v=2, n_layer=5, kv=1,
           optimizer="adamw"),
    layout("zb_h1", cp=2, stage=1, m=3),
    layout("1f1b", dp=2, stage=1, optimizer="adamw"),
    layout("interleaved_1f1b", dp=2, stage=1, v=2, n_layer=5),
    layout("zb_h1", dp=2, stage=2, m=3),
    layout("1f1b", dp=2, stage=2, tied=False, m=4, optimizer="adamw"),
    layout("1f1b", tp=2, stage=1, kv=1, optimizer="adamw"),
    layout("zb_h1", tp=2, stage=2),
    layout("1f1b", dp=2, stage=3, m=3, optimizer="adamw"),
    layout("zb_h1", dp=2, stage=3, m=3, reshard=True),
    layout("interleaved_1f1b", dp=2, stage=3, v=2, n_layer=5, reshard=True, tied=False),
    layout("interleaved_1f1b", dp=2, stage=3, v=2, n_layer=5),
]


@pytest.mark.parametrize("index", range(len(WORLD4)), ids=_ids(WORLD4))
def test_engine_pipeline_layout_pp_composed_trains_like_single_process(index):
    _check(4, WORLD4, index)


def test_engine_pipeline_layout_pp_sequence_parallel_sends_sequence_shards():
    """pp 2 x tp 2 with SP: each message between stages (second step: no shape headers) is a
    frame of the (1, T/t, C) shard and one status element; over all ranks m x shard x (p v - 1) x 2 x t bytes of data (every TP rank sends its own)."""
    for index, item in enumerate(WORLD4):
        spec = dict(item)
        if not spec["sp"]:
            continue
        shard = 1 * (SEQ // spec["tp"]) * 8 * 8  # rows x T/t x C x float64 bytes
        data = 0
        for rank_results in results(4, tuple(WORLD4)):
            _, _, rows, sends, _, pp_rank, *_ = rank_results[index]
            sent = sorted(nbytes for op, nbytes in rows if op == "isend")
            tied = VOCAB_PADDED_ROWS * 8 * 8 if spec["tied"] and pp_rank in (0, spec["pp"] - 1) else 0
            assert sent == sorted([shard + 8] * sends + ([tied] if tied else [])), spec
            data += sum(sent) - 8 * sends - tied
        assert data == spec["m"] * shard * (spec["pp"] * spec["v"] - 1) * 2 * spec["tp"], spec


VOCAB_PADDED_ROWS = 17  # ceil(33 / 2): one TP rank's rows of the tied table


def test_engine_pipeline_layout_pp_zero2_reduce_scatters_once_per_step():
    """ZeRO 2 under a pipeline: the schedule's backwards only accumulate, then one reduce-scatter
    per bucket (one bucket here) of this rank's parameters padded to a multiple of dp, float64:
    ceil(numel / dp) x dp x 8 bytes per step, whatever the number of micro-batches (m = 3, 4)."""
    for index, item in enumerate(WORLD4):
        spec = dict(item)
        if spec["stage"] != 2:
            continue
        for rank_results in results(4, tuple(WORLD4)):
            _, _, rows, _, local, *_ = rank_results[index]
            dp = spec["dp"]
            assert [nbytes for op, nbytes in rows if op == "reduce_scatter"] == [-(-local // dp) * dp * 8], spec


# More world-4 pairings (--thorough): the other schedules with ZeRO 2, cp with ZeRO 2 and dp, AFAB with SP.
WORLD4_MORE = [
    layout("interleaved_1f1b", dp=2, stage=2, v=2, n_layer=5, optimizer="adamw"),
    layout("interleaved_1f1b", tp=2, sp=True, stage=2, v=2, n_layer=5, kv=1),
    layout("afab", tp=2, sp=True, stage=1, tied=False, m=3),
    layout("1f1b", cp=2, stage=2, algorithm="ulysses", sharding="zigzag", optimizer="adamw"),
    layout("zb_h1", dp=2, stage=1, m=3, tied=False),
]


@pytest.mark.thorough  # more schedules per pairing
@pytest.mark.parametrize("index", range(len(WORLD4_MORE)), ids=_ids(WORLD4_MORE))
def test_engine_pipeline_layout_pp_more_pairings_train_like_single_process(index):
    _check(4, WORLD4_MORE, index)


def busy_periods(compute: list[tuple[str, int]], stage: int) -> int:
    """How often `stage` goes from no micro-batch in flight to one: a micro-batch is in flight
    from its forward (F) to the end of its backward (BW, or W after B)."""
    in_flight = periods = 0
    for kind, s in compute:
        if s != stage:
            continue
        periods += kind == F and in_flight == 0
        in_flight += (kind == F) - (kind in (BW, W))
    return periods


def test_engine_pipeline_layout_pp_zero3_all_gathers_match_the_formula():
    """ZeRO 3 under a pipeline, per rank and step (float64, dp 2): each stage of this rank is a
    unit of ceil(numel / dp) x dp x 8 bytes (padded to a multiple of dp). Kept from a
    micro-batch's forward to its backward, it is gathered once per busy period of the stage
    (once per step on every stage but 1F1B's last, where each forward is followed by its own
    backward: once per micro-batch); freed after every pass, once per compute action (m x 2, or
    m x 3 with zb_h1's B and W). The gradients: one reduce-scatter per unit, after the schedule;
    the step publishes shards, no all-gather. The memory report holds 1/dp of the padded
    parameters between steps, and 1/dp of the padded gradients before the step."""
    for index, item in enumerate(WORLD4):
        spec = dict(item)
        if spec["stage"] != 3:
            continue
        for rank_results in results(4, tuple(WORLD4)):
            _, _, rows, _, _, _, units, compute, memory = rank_results[index]
            stages = sorted({s for _, s in compute})
            padded = [-(-n // spec["dp"]) * spec["dp"] * 8 for n in units]
            passes = [sum(s == stage for _, s in compute) if spec["reshard"] else busy_periods(compute, stage)
                      for stage in stages]
            if spec["reshard"]:
                assert passes == [(3 if spec["schedule"] == "zb_h1" else 2) * spec["m"]] * len(stages)
            gathers = sorted(nbytes for op, nbytes in rows if op == "all_gather")
            assert gathers == sorted(b for b, n in zip(padded, passes) for _ in range(n)), spec
            # the memory report between steps: parameter shards; before the step: gradient shards
            assert memory == (sum(padded) // spec["dp"], sum(padded) // spec["dp"]), spec
            assert sorted(nbytes for op, nbytes in rows if op == "reduce_scatter") == sorted(padded), spec


# World 8: dp 2 x pp 2 x tp 2 (DDP, ZeRO 1, ZeRO 2; SP) and dp 2 x pp 2 x cp 2, in one pooled call.
WORLD8 = [
    layout("1f1b", dp=2, tp=2, kv=1),
    layout("interleaved_1f1b", dp=2, tp=2, sp=True, v=2, n_layer=5, stage=1, optimizer="adamw"),
    layout("zb_h1", dp=2, tp=2, stage=2, tied=False, m=3),
    layout("1f1b", dp=2, cp=2, stage=1, algorithm="ring"),
    layout("zb_h1", dp=2, tp=2, sp=True, stage=3, reshard=True, m=3, kv=1),
    layout("interleaved_1f1b", dp=2, cp=2, stage=3, v=2, n_layer=5, algorithm="ulysses", optimizer="adamw"),
]


@pytest.mark.thorough  # 8 ranks on the 2 CPU cores cost more than the default suite's share
@pytest.mark.parametrize("index", range(len(WORLD8)), ids=_ids(WORLD8))
def test_engine_pipeline_layout_pp_eight_ranks_train_like_single_process(index):
    _check(8, WORLD8, index)


def test_engine_pipeline_layout_pp_refuses_reshard_key_that_would_do_nothing():
    assert not dist.is_initialized()
    for spec, field in [(layout(stage=2, reshard=True), "parallel.pipeline_reshard_after_forward with "
                                                         "zero_optimization.stage=2"),
                        (layout(pp=1, stage=3, reshard=True), "parallel.pipeline_reshard_after_forward=True needs "
                                                              "parallel.pipeline > 1")]:
        with pytest.raises(ConfigError) as err:
            ts.initialize(gpt(dict(layout())), engine_config(dict(spec)))
        assert field in str(err.value)
    kept = engine_config(dict(layout(stage=3)))
    kept["zero_optimization"]["stage3_param_persistence_threshold"] = 100
    with pytest.raises(ConfigError, match="stage3_param_persistence_threshold=100 with parallel.pipeline=2"):
        ts.initialize(gpt(dict(layout())), kept)


def test_engine_pipeline_layout_pp_accepts_every_axis_before_any_process_group():
    """dp x pp x tp (with SP) and dp x pp x cp pass the layout checks at 8 ranks (no collectives)."""
    from tinyscale.engine.parallelize import check_layout
    for item in WORLD8:
        spec = dict(item)
        check_layout(EngineConfig.load(engine_config(spec)), gpt(spec), 8)


def _zero3_resume(directory: str):
    """dp 2 x pp 2 at ZeRO 3 (kept): a step, saved; loaded by a ZeRO 3 engine that reshards (other
    values), a second step; its full state. The checkpoint holds whole tensors by name."""
    spec = dict(layout("1f1b", dp=2, stage=3, optimizer="adamw"))
    data = batches(spec)
    first = ts.initialize(gpt(spec), engine_config(spec))
    losses = [first.train_batch(data[0])]
    first.save_checkpoint(f"{directory}/a")
    again = spec | {"schedule": "zb_h1", "reshard": True}
    second = ts.initialize(gpt(again, seed=99), engine_config(again))
    second.load_checkpoint(f"{directory}/a")
    losses.append(second.train_batch(data[1]))
    return losses, second.full_state_dict()


def test_engine_pipeline_layout_pp_zero3_checkpoint_resumes(tmp_path):
    """ZeRO 3 under a pipeline saves whole tensors (AdamW's state by name, the tied table once)
    and a resharding engine resumes from them like one process (float64, rtol 1e-10)."""
    spec = dict(layout("1f1b", dp=2, stage=3, optimizer="adamw"))
    expected_losses, expected = reference(spec)
    for losses, state in run_on_ranks(_zero3_resume, 4, str(tmp_path)):
        assert_losses_close(losses, expected_losses)
        assert_state_dicts_close(state, expected, what="after resuming dp 2 x pp 2 at ZeRO 3")


def _zero3_one_rank_raises():
    """dp 2 x pp 2 at ZeRO 3 (freed after every pass): step 0's second loss raises on one rank of
    the last stage only; its dp peer goes on gathering over dp. The batch is then retried."""
    spec = dict(layout("1f1b", dp=2, stage=3, reshard=True, optimizer="adamw"))
    engine = ts.initialize(gpt(spec), engine_config(spec))
    executor, calls = engine.pipeline.executor, {"loss": 0}
    loss_fn = executor.loss_fn

    def flaky_loss(logits, targets):
        calls["loss"] += 1
        if calls["loss"] == 2 and dist.get_rank() == 2:
            raise MemoryError("simulated: loss")
        return loss_fn(logits, targets)
    executor.loss_fn = flaky_loss
    data = batches(spec)
    with pytest.raises(Exception) as info:
        engine.train_batch(data[0])
    losses = [engine.train_batch(b) for b in data]
    return type(info.value).__name__, losses, engine.full_state_dict()


def test_engine_pipeline_layout_pp_zero3_failed_step_on_one_rank_is_dropped_everywhere():
    """The executor calls ZeRO 3's gather hooks on a rank whose compute raised, so its dp peer's
    all-gathers are matched (no hang): every rank drops the step, the retry trains like one process."""
    spec = dict(layout("1f1b", dp=2, stage=3, reshard=True, optimizer="adamw"))
    expected_losses, expected = reference(spec)
    for rank, (raised, losses, state) in enumerate(run_on_ranks(_zero3_one_rank_raises, 4, timeout_s=60)):
        assert raised == ("MemoryError" if rank == 2 else "StepFailed")
        assert_losses_close(losses, expected_losses)
        assert_state_dicts_close(state, expected, what=f"rank {rank} after a dropped ZeRO 3 step")
