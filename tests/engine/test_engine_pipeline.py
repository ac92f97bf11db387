"""The engine with `parallel.pipeline` trains the GPT exactly like one process.

- every schedule (afab, 1f1b, interleaved_1f1b with 2 chunks, zb_h1) at p = 2 and p = 4, and
  dp x pp = 2 x 2 with DDP (clipping by the whole model's norm) and with ZeRO stage 1 over dp:
  losses and `full_state_dict()` (original keys and order, on every rank) equal
  `tinyscale.reference.train` (float64, rtol 1e-10), tied embeddings and layer counts the
  stages do not divide included;
- the ledger of the second step: the sends and receives the schedule lowers to, each a frame
  (the activation and one status element; the shapes went in step 1's headers), m x
  activation x boundaries x 2 bytes of data in all;
- pp 2 x tp 2 (1F1B, interleaved with 2 chunks, zb_h1; tied, GQA with K/V heads split or
  replicated, a vocab tp does not divide, clipping, ZeRO 1): losses and `full_state_dict()`
  equal `tinyscale.reference.train` (float64, rtol 1e-10), in one 4-rank call;
- a checkpoint written at pp 2 resumes at pp 1 and the reverse, continuing as one process;
- layouts the engine cannot serve are refused with a ConfigError naming the field, before any
  process group is made.
The pipeline with the other axes (dp x pp x tp, SP, cp) and ZeRO 1-3 with clipping:
`test_engine_pipeline_compose.py`.
The layouts of one world size run in one pooled multi-rank call (cached per module).
A step that raised on one stage: `test_engine_pipeline_failed_step.py`.
Run: `pytest tests/engine/test_engine_pipeline.py` (keys engine_pipeline, pp_afab, pp_1f1b, pp_interleaved,
pp_zero_bubble).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.config import ConfigError, EngineConfig
from tinyscale.data import synthetic_token_batches
from tinyscale.engine.engine import check_supported
from tinyscale.models import GPT, GPTConfig, TinyMLP
from tinyscale.pipeline.schedules import SEND_B, SEND_F
from tinyscale.testing import (
    assert_every_rank_trained_like, assert_losses_close, assert_state_dicts_close, run_on_ranks,
)

VOCAB, SEQ, STEPS = 32, 4, 2
OPTIMIZERS = {  # SGD too: Adam hides a uniform gradient-scale bug (a missing or doubled reduction)
    "adamw": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}},
    "sgd": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}},
}
KEYS = {"afab": "pp_afab", "1f1b": "pp_1f1b", "interleaved_1f1b": "pp_interleaved", "zb_h1": "pp_zero_bubble"}
CLIP = 0.05  # the gradient norm here is ~1: every step clips


def gpt(n_layer: int, tied: bool, seed: int = 5) -> GPT:
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=n_layer, n_head=2, d_model=8, ffn_hidden=12,
                    tie_embeddings=tied)
    return GPT(cfg, seed=seed, dtype=torch.float64)


def run_config(pp: int, dp: int, schedule: str, m: int, optimizer: str, v: int = 1, stage: int = 0,
               clip: float = 0.0) -> dict:
    parallel = {"pipeline": pp, "pipeline_schedule": schedule} | ({"virtual_stages": v} if v > 1 else {})
    return {"train_batch_size": m * dp, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": m,
            "optimizer": OPTIMIZERS[optimizer], "gradient_clipping": clip, "zero_optimization": {"stage": stage},
            "parallel": parallel}


def batches(rows: int, steps: int = STEPS):
    return synthetic_token_batches(num_batches=steps, batch_size=rows, seq_len=SEQ, vocab_size=VOCAB, seed=3)


# (schedule, n_layer, tied, m, v, optimizer, dp, zero stage, clip): n_layer never a multiple of p x v
P2 = [("afab", 3, True, 3, 1, "adamw", 1, 0, 0.0), ("1f1b", 3, True, 2, 1, "sgd", 1, 0, CLIP),
      ("interleaved_1f1b", 5, True, 2, 2, "sgd", 1, 0, 0.0), ("zb_h1", 3, False, 3, 1, "sgd", 1, 0, CLIP)]
P4 = [("afab", 5, False, 2, 1, "sgd", 1, 0, 0.0), ("1f1b", 5, True, 3, 1, "adamw", 1, 0, 0.0),
      ("interleaved_1f1b", 9, True, 4, 2, "sgd", 1, 0, 0.0), ("zb_h1", 6, True, 5, 1, "sgd", 1, 0, CLIP)]
DP2_PP2 = [("1f1b", 3, True, 2, 1, "sgd", 2, 0, CLIP), ("zb_h1", 3, True, 3, 1, "adamw", 2, 1, 0.0),
           ("interleaved_1f1b", 5, False, 2, 2, "sgd", 2, 1, 0.0)]


def _train_layouts(layouts: list[tuple]):
    """On each rank: every layout's engine trained STEPS steps; its losses, full state and the
    p2p rows of its last step's ledger (with what the schedule says this rank sends)."""
    out = []
    for name, n_layer, tied, m, v, optimizer, dp, stage, clip in layouts:
        pp = dist.get_world_size() // dp
        engine = ts.initialize(gpt(n_layer, tied), run_config(pp, dp, name, m, optimizer, v, stage, clip))
        losses = []
        for b in batches(m * dp):
            engine.comm_ledger.clear()
            losses.append(engine.train_batch(b))
        p2p = [(row.op, row.bytes) for row in engine.comm_ledger.rows if row.op in ("isend", "irecv")]
        sends = sum(a.kind in (SEND_F, SEND_B) for a in engine.pipeline.schedule[engine.pipeline.rank])
        out.append((losses, engine.full_state_dict(), p2p, sends))
    return out


@functools.cache
def results(world: int, layouts: tuple) -> list:
    return run_on_ranks(_train_layouts, world, list(layouts))


def reference(name, n_layer, tied, m, v, optimizer, dp, stage, clip):
    model = gpt(n_layer, tied)
    losses = ts.reference.train(model, batches(m * dp), run_config(1, 1, "1f1b", m * dp, optimizer, clip=clip)
                                | {"parallel": {}})
    return losses, model.state_dict()


def _check(world: int, layouts: list[tuple], index: int) -> None:
    layout = layouts[index]
    expected_losses, expected = reference(*layout)
    assert_every_rank_trained_like([r[index] for r in results(world, tuple(layouts))], expected_losses, expected,
                                   what=f"{layout} full_state_dict after {STEPS} steps")


def _ids(layouts):
    return [f"{KEYS[layout[0]]}-dp{layout[6]}-zero{layout[7]}" for layout in layouts]


@pytest.mark.parametrize("index", range(len(P2)), ids=_ids(P2))
def test_engine_pipeline_two_stages_train_like_single_process(index):
    _check(2, P2, index)


@pytest.mark.parametrize("index", range(len(P4)), ids=_ids(P4))
def test_engine_pipeline_four_stages_train_like_single_process(index):
    _check(4, P4, index)


@pytest.mark.parametrize("index", range(len(DP2_PP2)), ids=_ids(DP2_PP2))
def test_engine_pipeline_dp2_pp2_trains_like_single_process(index):
    """DDP's buckets all-reduced once after the schedule (with clipping), or ZeRO 1 over dp."""
    _check(4, DP2_PP2, index)


@pytest.mark.parametrize("world, layouts", [(2, P2), (4, P4)], ids=["p2", "p4"])
def test_engine_pipeline_ledger_counts_the_schedules_messages(world, layouts):
    """The second step's p2p: per message one frame, the (rows, T, C) activation or its gradient
    and one status element (the shapes are known from step 1's headers); over all ranks
    m x activation x (p v - 1) x 2 bytes of data."""
    for index, (name, n_layer, tied, m, v, *_rest) in enumerate(layouts):
        activation = 1 * SEQ * 8 * 8  # rows x T x C x float64 bytes
        tied_bytes = VOCAB * 8 * 8 if tied else 0  # the tied table's gradient, first <-> last stage
        data = 0
        for rank, rank_results in enumerate(results(world, tuple(layouts))):
            _, _, p2p, sends = rank_results[index]
            tied_here = tied and rank in (0, world - 1)
            for op in ("isend", "irecv"):
                sizes = sorted(nbytes for kind, nbytes in p2p if kind == op)
                assert sizes == sorted([activation + 8] * sends + [tied_bytes] * tied_here), (name, op)
            data += sum(nbytes for kind, nbytes in p2p if kind == "isend") - 8 * sends - tied_bytes * tied_here
        assert data == m * activation * (world * v - 1) * 2, name


def _resume_body(directory: str):
    """1F1B at pp 2 for a step, saved; loaded at pp 1 (dp 2) for a step, saved; loaded at pp 2
    with zb_h1 for a third step. Tied table, AdamW (its state must travel)."""
    data, m = batches(2, steps=3), 2
    first = ts.initialize(gpt(3, True), run_config(2, 1, "1f1b", m, "adamw"))
    losses = [first.train_batch(data[0])]
    first.save_checkpoint(f"{directory}/a")
    flat = run_config(1, 2, "1f1b", 1, "adamw") | {"parallel": {}}
    second = ts.initialize(gpt(3, True, seed=99), flat)  # other values: all must load
    second.load_checkpoint(f"{directory}/a")
    losses.append(second.train_batch(data[1]))
    second.save_checkpoint(f"{directory}/b")
    third = ts.initialize(gpt(3, True, seed=98), run_config(2, 1, "zb_h1", m, "adamw"))
    third.load_checkpoint(f"{directory}/b")
    losses.append(third.train_batch(data[2]))
    bad = data[0][0].clone()
    bad[0, 1] = VOCAB  # refused on every rank before the schedule: none waits for a stage that raised
    with pytest.raises(ValueError, match=f"idx contains token id {VOCAB} at position \\(0, 1\\)"):
        third.train_batch((bad, data[0][1]))
    state = third.full_state_dict()
    with torch.no_grad():  # a diverged loss: every rank drops the step together
        for q in third.model.parameters():
            q.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="training diverged"):
        third.train_batch(data[0])
    assert all(q.grad is None for q in third.model.parameters())
    return losses, state


def test_engine_pipeline_checkpoint_resumes_across_layouts(tmp_path):
    """pp 2 -> pp 1 -> pp 2 continues like one process trained 3 steps (float64, rtol 1e-10);
    then a token id outside the vocab is refused on both ranks alike, and a NaN loss drops the step."""
    model = gpt(3, True)
    expected_losses = ts.reference.train(model, batches(2, steps=3),
                                         run_config(1, 1, "1f1b", 2, "adamw") | {"parallel": {}})
    for losses, state in run_on_ranks(_resume_body, 2, str(tmp_path)):
        assert_losses_close(losses, expected_losses)
        assert_state_dicts_close(state, model.state_dict(), what="after resuming at pp 1 and again at pp 2")


def test_engine_pipeline_refuses_what_it_cannot_serve_before_any_process_group():
    assert not dist.is_initialized()
    base = run_config(2, 1, "1f1b", 2, "sgd")

    def refused(config: dict, *fields: str, model=None) -> None:
        with pytest.raises(ConfigError) as err:
            ts.initialize(model if model is not None else gpt(3, True), config)
        for field in fields:
            assert field in str(err.value), (field, str(err.value))

    refused(base, "parallel.pipeline=2 x parallel.context=1 x parallel.tensor=1 does not divide the world size 1")
    for precision in ("bf16", "fp16"):  # served (tests/engine/test_layout_mixed_precision.py): no refusal
        check_supported(EngineConfig.load(base | {precision: {"enabled": True}}))
    # served since issue 25 (tests/engine/test_layout_activation_checkpointing.py, test_layout_offload.py);
    # a re-entrant checkpoint cannot be split into zero-bubble's B and W passes
    check_supported(EngineConfig.load(base | {"activation_checkpointing": {"policy": "full"}}))
    offload = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    check_supported(EngineConfig.load(base | offload))
    with pytest.raises(ConfigError, match="activation_checkpointing.use_reentrant=true .*zb_h1"):
        check_supported(EngineConfig.load(run_config(2, 1, "zb_h1", 2, "sgd")
                                          | {"activation_checkpointing": {"policy": "full", "use_reentrant": True}}))
    refused(base | {"parallel": {"pipeline": 2, "virtual_stages": 2}}, "parallel.virtual_stages=2",
            "'interleaved_1f1b'")
    refused({"train_batch_size": 2, "parallel": {"pipeline_schedule": "zb_h1"}}, "parallel.pipeline_schedule",
            "needs parallel.pipeline > 1")
    refused({"train_batch_size": 2, "parallel": {"virtual_stages": 2}}, "parallel.virtual_stages")
    with pytest.raises(ConfigError, match="pipeline_schedule"):  # the old names are not the issue's
        ts.initialize(gpt(3, True), base | {"parallel": {"pipeline": 2, "pipeline_schedule": "zero_bubble"}})


def test_engine_pipeline_refuses_bad_layouts_naming_the_field():
    """Checked with the world size before any collective (`check_layout` is pure)."""
    from tinyscale.engine.parallelize import check_layout

    def refused(config: dict, world: int, model, *fields: str) -> None:
        with pytest.raises(ConfigError) as err:
            check_layout(EngineConfig.load(config), model, world)
        for field in fields:
            assert field in str(err.value), (field, str(err.value))

    check_layout(EngineConfig.load(run_config(2, 2, "interleaved_1f1b", 4, "sgd", v=2)), gpt(4, True), 4)
    refused(run_config(4, 1, "1f1b", 4, "sgd"), 4, gpt(3, True), "parallel.pipeline=4", "n_layer=3")
    refused(run_config(2, 1, "interleaved_1f1b", 4, "sgd", v=2), 2, gpt(3, True), "parallel.virtual_stages=2")
    refused(run_config(2, 1, "interleaved_1f1b", 3, "sgd", v=2), 2, gpt(4, True), "gradient_accumulation_steps=3",
            "use 4")
    refused(run_config(2, 1, "1f1b", 2, "sgd"), 3, gpt(4, True), "does not divide the world size 3")
    refused(run_config(2, 1, "1f1b", 2, "sgd"), 2, TinyMLP(4, 8), "TinyMLP")
    check_layout(EngineConfig.load(tp_config("1f1b", 1, 0, 0.0)), tp_gpt(True, 1), 4)  # pp 2 x tp 2 is served
    check_layout(EngineConfig.load(tp_config("1f1b", 1, 0, 0.0) | {"train_batch_size": 4}), tp_gpt(True, 1),
                 8)  # and dp 2 x pp 2 x tp 2
    dropout = GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=2, n_head=2, d_model=8, dropout=0.1))
    refused(run_config(2, 1, "1f1b", 2, "sgd"), 2, dropout, "GPTConfig.dropout=0.1",
            "dropout_masks='counter'")  # stream masks refused; counter masks are served (-k layout_dropout)


# pp 2 x tp 2 (world 4): (schedule, v, tied, n_kv_head, zero stage, clip). A vocab tp does not divide
# (padded to 34 rows, 17 per TP rank: the first stage's embedding shard i and the last stage's head
# shard i are the same rows); GQA with K/V heads split over tp (2) and replicated (1).
TP_VOCAB = 33
PP2_TP2 = [("1f1b", 1, True, 1, 0, CLIP), ("interleaved_1f1b", 2, True, 2, 0, 0.0),
           ("zb_h1", 1, False, 2, 1, 0.0)]


def tp_gpt(tied: bool, n_kv_head: int, seed: int = 5) -> GPT:
    cfg = GPTConfig(vocab_size=TP_VOCAB, max_seq_len=SEQ, n_layer=5, n_head=4, n_kv_head=n_kv_head, d_model=8,
                    ffn_hidden=12, tie_embeddings=tied)
    return GPT(cfg, seed=seed, dtype=torch.float64)


def tp_batches(rows: int):
    return synthetic_token_batches(num_batches=STEPS, batch_size=rows, seq_len=SEQ, vocab_size=TP_VOCAB, seed=3)


def tp_config(schedule: str, v: int, stage: int, clip: float, m: int = 2) -> dict:
    config = run_config(2, 1, schedule, m, "adamw" if stage else "sgd", v, stage, clip)
    return config | {"parallel": config["parallel"] | {"tensor": 2}}


def _train_pp_tp(layouts: list[tuple]):
    out = []
    for schedule, v, tied, kv, stage, clip in layouts:
        engine = ts.initialize(tp_gpt(tied, kv), tp_config(schedule, v, stage, clip))
        losses = [engine.train_batch(b) for b in tp_batches(2)]
        out.append((losses, engine.full_state_dict()))
    return out


@functools.cache
def pp_tp_results() -> list:
    return run_on_ranks(_train_pp_tp, 4, PP2_TP2)


@pytest.mark.parametrize("index", range(len(PP2_TP2)),
                         ids=[f"{KEYS[s]}-kv{kv}-zero{z}-clip{c > 0:d}" for s, _, _, kv, z, c in PP2_TP2])
def test_engine_pipeline_pp2_tp2_trains_like_single_process(index):
    """Each TP rank's stages split over tp, activations passed TP rank i -> TP rank i, the last
    stage's vocab-parallel loss, the tied table's shards paired across the pipeline, clipping by
    the norm over pp x tp: losses and full_state_dict equal one process (float64, rtol 1e-10)."""
    schedule, v, tied, kv, stage, clip = PP2_TP2[index]
    model = tp_gpt(tied, kv)
    expected_losses = ts.reference.train(model, tp_batches(2), tp_config(schedule, v, stage, clip)
                                         | {"parallel": {}})
    for rank_results in pp_tp_results():
        losses, state = rank_results[index]
        assert_losses_close(losses, expected_losses)
        assert list(state) == list(model.state_dict())  # the original keys, in order, on every rank
        assert_state_dicts_close(state, model.state_dict(), what=f"{PP2_TP2[index]} after {STEPS} steps")


def _pp_tp_resume(directory: str):
    """pp 2 x tp 2: 1F1B for a step, saved; loaded by a zb_h1 engine of other values, a second step."""
    data = tp_batches(2)
    first = ts.initialize(tp_gpt(True, 1), tp_config("1f1b", 1, 1, 0.0))
    losses = [first.train_batch(data[0])]
    first.save_checkpoint(f"{directory}/a")
    second = ts.initialize(tp_gpt(True, 1, seed=99), tp_config("zb_h1", 1, 1, 0.0))
    second.load_checkpoint(f"{directory}/a")
    losses.append(second.train_batch(data[1]))
    return losses, second.full_state_dict()


def test_engine_pipeline_pp2_tp2_checkpoint_resumes(tmp_path):
    """The checkpoint holds full tensors (TP gathered, then the stages): AdamW's state travels,
    the tied table once; the resumed run continues like one process (float64, rtol 1e-10)."""
    model = tp_gpt(True, 1)
    expected_losses = ts.reference.train(model, tp_batches(2), tp_config("1f1b", 1, 1, 0.0) | {"parallel": {}})
    for losses, state in run_on_ranks(_pp_tp_resume, 4, str(tmp_path)):
        assert_losses_close(losses, expected_losses)
        assert_state_dicts_close(state, model.state_dict(), what="after resuming at pp 2 x tp 2")
