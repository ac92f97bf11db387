"""Changing the batch size or the layout during training (`engine/batch_change.py`, lesson 12).

    pytest -k batch_change     set_train_batch_size / set_train_micro_batch_size, the ramp-up, DeepSpeed 0.19.8
    pytest -k layout_change    save under one layout and batch, go on under another

The model is the odd GPT (vocab 61, 6 query on 2 K/V heads, tied embedding and head, 3 layers),
float64, AdamW with weight decay, clipping that binds and a WarmupLR schedule. The truth is
`tinyscale.reference.train` fed the same global batches, whatever their sizes (its config names
only the micro-batch, which cuts without changing the math). Every comparison is at rtol 1e-10:
a float64 reduction in another order differs by ~1e-15 per op; 1e-10 leaves 5 orders of margin
and still fails on any real error (a micro-batch scaled by the old accumulation is off by 2x).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
import tinyscale.deepspeed as deepspeed
from tinyscale.config import ConfigError
from tinyscale.data import local_micro_batches, synthetic_token_batches
from tinyscale.engine.batch_change import rampup_batch_size
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks

VOCAB, SEQ = 61, 10
RTOL = 1e-10  # see the module docstring
LR = 1e-2


def gpt(frozen: bool = False) -> GPT:
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=3, n_head=6, n_kv_head=2, d_model=12,
                    ffn_hidden=20, tie_embeddings=True)
    model = GPT(cfg, seed=7, dtype=torch.float64)
    if frozen:  # a frozen matrix: no gradient, no state, never stepped, in every layout
        model.blocks[1].attn.wk.weight.requires_grad_(False)
    return model


def config(micro: int = 1, accum: int = 1, stage: int = 0, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
            "gradient_clipping": 0.3,  # this model's gradient norm is ~1-2: every step clips
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
            # from 1e-3: DeepSpeed's WarmupLR gives its min to the first two steps, which then move too
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_min_lr": 1e-3,
                                                         "warmup_max_lr": LR}},
            "zero_optimization": {"stage": stage}, **extra}


def batches_of(sizes: list[int], seed: int = 3) -> list[tuple[torch.Tensor, ...]]:
    """One global batch per step, of the given row counts, cut in order from one stream of 96 rows."""
    rows = synthetic_token_batches(num_batches=1, batch_size=96, seq_len=SEQ, vocab_size=VOCAB, seed=seed)[0]
    cuts = torch.tensor([0, *sizes]).cumsum(0).tolist()
    return [tuple(t[a:b] for t in rows) for a, b in zip(cuts, cuts[1:])]


def reference(sizes: list[int], frozen: bool = False) -> tuple[list[float], dict]:
    model = gpt(frozen)
    # micro 1: any batch is whole micro-batches; the cut does not change the mean's gradient
    losses = ts.reference.train(model, batches_of(sizes), config(micro=1))
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


# Calls before a step -> the step's global batch on 3 ranks (micro 1, accumulation 1 at first):
# accumulation 1 -> 2 -> micro 2 (accumulation kept) -> accumulation 1 -> 3 -> micro 1 (accumulation kept).
CHANGES = {2: ("batch", 6), 3: ("micro", 2), 4: ("batch", 6), 5: ("batch", 18), 6: ("micro", 1)}


def _schedule(world: int, changes: dict) -> list[int]:
    sizes, size, micro, accum = [], world, 1, 1
    for step in range(max(changes) + 2):
        kind, n = changes.get(step, (None, None))
        if kind == "batch":
            size, accum = n, n // (micro * world)
        elif kind == "micro":
            size, micro = n * accum * world, n
        sizes.append(size)
    return sizes


def _train_with_changes(stage: int, changes: dict) -> tuple[list[float], dict, list[tuple]]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    engine = ts.initialize(gpt(frozen=True), config(stage=stage))
    sizes, seen, losses = _schedule(world, changes), [], []
    for step, batch in enumerate(batches_of(sizes)):
        kind, n = changes.get(step, (None, None))
        if kind == "batch":
            engine.set_train_batch_size(n)
        elif kind == "micro":
            engine.set_train_micro_batch_size(n)
        b = engine.batch
        seen.append((b.train_batch_size, b.micro_batch_size, b.gradient_accumulation_steps))
        losses.append(engine.train_batch(batch))
    assert engine.samples == sum(sizes)
    return losses, engine.full_state_dict(), seen


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_batch_change_every_zero_stage_on_three_ranks_trains_as_one_process(stage):
    """3 ranks, the batch changing by accumulation and by micro-batch size, up and down, mid
    warm-up: every step's loss and the final parameters equal one process fed the same batches,
    so the optimizer state and the schedule's position went through every change untouched (a
    frozen matrix stays frozen)."""
    sizes = _schedule(3, CHANGES)
    assert sizes == [3, 3, 6, 12, 6, 18, 9, 9]
    results = run_on_ranks(_train_with_changes, 3, stage, CHANGES)
    expected, state = reference(sizes, frozen=True)
    for losses, final, seen in results:
        assert_losses_close(losses, expected, rtol=RTOL)
        assert_state_dicts_close(final, state, rtol=RTOL)
        assert seen[2:7] == [(6, 1, 2), (12, 2, 2), (6, 2, 1), (18, 2, 3), (9, 1, 3)]  # DeepSpeed's rules


def test_batch_change_rules_refusals_and_lr_scaling_in_one_process(tmp_path):
    engine = ts.initialize(gpt(), {**config(micro=2, accum=2), "scheduler": None})  # the lr: LR every step
    with pytest.raises(ValueError, match="multiple of train_micro_batch_size_per_gpu x data-parallel size = 2 x 1"):
        engine.set_train_batch_size(5)  # DeepSpeed's ValueError, with the numbers
    with pytest.raises(ValueError, match="lr_scaling"):
        engine.set_train_batch_size(8, lr_scaling="cubic")
    assert engine.batch.train_batch_size == 4  # a refused call changed nothing
    batches = batches_of([4, 16, 16, 8])
    engine.train_batch(batches[0])
    engine.set_train_batch_size(16, lr_scaling="linear")  # 4x the config's batch
    engine.train_batch(batches[1])
    lr = engine._torch_optimizer().param_groups[0]["lr"]
    assert lr == LR * 4 and engine.lr_scale == 4
    engine.set_train_batch_size(16, lr_scaling="sqrt")  # relative to the config's batch, not the last call's
    engine.train_batch(batches[2])
    assert engine._torch_optimizer().param_groups[0]["lr"] == LR * 2
    engine.set_train_micro_batch_size(1)  # accumulation 8 kept: 8 rows; no lr_scaling: the config's lr again
    assert (engine.batch.train_batch_size, engine.batch.gradient_accumulation_steps, engine.lr_scale) == (8, 8, 1.0)
    engine.train_batch(batches[3])
    assert engine._torch_optimizer().param_groups[0]["lr"] == LR
    assert engine.samples == 44
    engine.set_train_batch_size(16, lr_scaling="linear")
    engine.save_checkpoint(tmp_path / "c")  # keeps the samples; the batch set by a call is not the config's
    resumed = ts.initialize(gpt(), {**config(micro=2, accum=2), "scheduler": None})
    resumed.load_checkpoint(tmp_path / "c")
    assert (resumed.samples, resumed.batch.train_batch_size, resumed.lr_scale) == (44, 4, 1.0)


def test_batch_change_keeps_the_fp16_loss_scale_and_trains_as_one_process():
    """fp16 in one process: the scale and its growth counter go through the change; every loss
    and parameter equals the reference's fed the same batches (the same ops in the same order)."""
    cfg = config(micro=1, fp16={"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2})
    engine = ts.initialize(gpt(), cfg)
    sizes = [1, 1, 1, 3, 3]
    losses = []
    for step, batch in enumerate(batches_of(sizes)):
        if step == 3:
            before = engine.loss_scaler.state_dict()
            engine.set_train_batch_size(3)
            assert engine.loss_scaler.state_dict() == before
        losses.append(engine.train_batch(batch))
    model = gpt()
    expected = ts.reference.train(model, batches_of(sizes), cfg)
    assert engine.loss_scaler.scale > 2 ** 4  # it grew, across the change
    assert losses == expected
    assert_state_dicts_close(engine.full_state_dict(), model.state_dict(), rtol=0)


def _ranks_disagree() -> str:
    engine = ts.initialize(gpt(), config())
    try:
        engine.set_train_batch_size(2 * (1 + dist.get_rank()))  # rank 0 asks for 2 rows, rank 1 for 4
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_batch_change_ranks_asking_for_different_batches_all_raise():
    said = run_on_ranks(_ranks_disagree, 2)
    assert all("ranks asked for different changes" in s for s in said), said


def _pipeline_refusals() -> list[str]:
    said = []
    for ramp in ({"start": 2, "increment": 2, "samples": 8}, None):
        try:
            engine = ts.initialize(gpt(), config(accum=4, rampup_batch_size=ramp, parallel={"pipeline": 2}))
            engine.set_train_batch_size(8)
        except ConfigError as exc:
            said.append(str(exc))
    return said


def test_batch_change_is_refused_under_a_pipeline_and_inside_an_open_step():
    for said in run_on_ranks(_pipeline_refusals, 2):
        assert said[0].startswith("rampup_batch_size with parallel.pipeline=2: the pipeline's schedule is lowered")
        assert said[1].startswith("set_train_batch_size(8) with parallel.pipeline=2") and "checkpoint" in said[1]
    ds, _, _, _ = deepspeed.initialize(model=gpt(), config=config(accum=2))
    ds(*batches_of([1])[0])
    with pytest.raises(RuntimeError, match="inside an open step"):
        ds.set_train_batch_size(4)


# --- the DeepSpeed loop -------------------------------------------------------------------------

def test_batch_change_deepspeed_loop_equals_train_batch_across_the_change():
    """The loop's accumulation boundary follows the new gradient_accumulation_steps (counted in
    the open step), so a loop fed the micro-batches equals train_batch bit for bit."""
    sizes = [2, 2, 6, 6, 4]  # micro 2: accumulation 1, 1, 3, 3, 2; DeepSpeed's micro_steps-based
    batches = batches_of(sizes)  # boundary would end step 3 after 1 of its 3 micro-batches (2 + 1 = 3)
    engine = ts.initialize(gpt(), config(micro=2))
    ds, _, _, _ = deepspeed.initialize(model=gpt(), config=config(micro=2))
    expected, losses, steps_per_batch = [], [], []
    for size, batch in zip(sizes, batches):
        if engine.batch.train_batch_size != size:
            engine.set_train_batch_size(size)
            ds.set_train_batch_size(size)
        expected.append(engine.train_batch(batch))
        before = ds.global_steps
        for chunk in local_micro_batches(batch, dp_rank=0, dp_size=1, micro_batch_size=2):
            ds.backward(ds(*chunk))
            ds.step()
        steps_per_batch.append(ds.global_steps - before)
        losses.append(ds.engine.last_step["loss"])
    assert steps_per_batch == [1] * len(sizes) and ds.global_samples == sum(sizes)
    assert losses == expected
    for k, v in engine.full_state_dict().items():
        assert torch.equal(v, ds.engine.full_state_dict()[k]), k


@pytest.mark.thorough  # 44 s in the default suite (two DeepSpeed processes); the float64 tests above stay
def test_batch_change_deepspeed_agreement_losses_follow_deepspeeds_across_the_change():
    """DeepSpeed 0.19.8 itself (its own process, DS_ACCELERATOR=cpu, gloo, 2 ranks, float32):
    set_train_batch_size on both engines before steps 2 and 4 (8 -> 16 -> 8 rows, accumulation
    2 -> 4 -> 2, at micro_steps that DeepSpeed's boundary count divides); every loss agrees at
    the float32 bound of the agreement tests, and both with one float64 process. 9 s
    (DeepSpeed's inference-only shared-memory op skipped: `deepspeed_peer.skip_shm_op`)."""
    from tinyscale.testing import deepspeed_peer

    if not deepspeed_peer.available():
        pytest.skip("DeepSpeed is not installed: pip install -e '.[peers]'")
    from tests.engine.test_deepspeed_agreement import GPT_SMALL

    sizes = [8, 8, 16, 16, 8]
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
    rows = synthetic_token_batches(num_batches=1, batch_size=sum(sizes), seq_len=16,
                                   vocab_size=GPT_SMALL["vocab_size"], seed=1)[0]
    cuts = torch.tensor([0, *sizes]).cumsum(0).tolist()
    payload = {"world_size": 2, "stages": [0, 2], "model": GPT_SMALL, "seed": 0, "dtype": "float32",
               "batches": [[t[a:b].tolist() for t in rows] for a, b in zip(cuts, cuts[1:])],
               "config": config, "batch_sizes": sizes}
    theirs = deepspeed_peer.run("train", payload, timeout_s=900)
    model = GPT(GPTConfig(**GPT_SMALL), seed=0, dtype=torch.float64)
    truth = ts.reference.train(model, [tuple(torch.tensor(t) for t in b) for b in payload["batches"]],
                               {k: v for k, v in config.items() if k != "train_batch_size"})
    for stage in ("0", "2"):
        ds, ours = theirs[stage]["deepspeed"]["losses"], theirs[stage]["tinyscale"]["losses"]
        # float32 on both sides: the agreement tests' bounds (2e-6: ~30 ulps of summation order;
        # 1e-4 against float64), derived in tests/engine/test_deepspeed_agreement.py
        assert all(math.isclose(a, b, rel_tol=2e-6) for a, b in zip(ds, ours)), (stage, ds, ours)
        assert all(math.isclose(b, r, rel_tol=1e-4) for b, r in zip(ours, truth)), (stage, ours, truth)
        # each engine's accumulation at every step: DeepSpeed's rule on both (micro 2 x dp 2 kept)
        assert theirs[stage]["deepspeed"]["accumulation"] == theirs[stage]["tinyscale"]["accumulation"] == \
            [2, 2, 4, 4, 2]


# --- the ramp-up ----------------------------------------------------------------------------------

def test_batch_change_rampup_follows_megatrons_formula():
    # NeMo's documented example: 256 -> 1024 by 128 over 50M samples: 6 increments of 8.33M samples
    sizes = [rampup_batch_size(256, 128, 50_000_000, 1024, s)
             for s in (0, 8_333_333, 8_333_334, 25_000_000, 49_999_999, 50_000_000, 50_000_001)]
    assert sizes == [256, 256, 384, 640, 896, 1024, 1024]  # Megatron: int(50M / 8.33M) = 6 increments at 50M
    assert rampup_batch_size(4, 4, 100, 4, 0) == 4  # start = final: no ramp


def _rampup_run(path: str, resume: bool) -> tuple[list[float], dict, list[int]]:
    cfg = config(accum=8, rampup_batch_size={"start": 2, "increment": 2, "samples": 12})
    engine = ts.initialize(gpt(), cfg)
    sizes, losses = [], []
    stream = batches_of([1] * 96)  # rows drawn in order, as many as each step's batch needs
    rows = 0
    for step in range(7):
        if resume and step == 3:  # a new engine from the checkpoint: the ramp goes on where it was
            engine.save_checkpoint(path)
            engine = ts.initialize(gpt(), cfg)
            engine.load_checkpoint(path)
        n = engine.batch.train_batch_size
        batch = tuple(torch.cat([b[k] for b in stream[rows:rows + n]]) for k in range(2))
        rows += n
        sizes.append(n)
        losses.append(engine.train_batch(batch))
    return losses, engine.full_state_dict(), sizes


def test_batch_change_rampup_grows_the_batch_by_samples_and_resumes_mid_ramp(tmp_path):
    with pytest.raises(ConfigError, match="whole increments"):
        ts.initialize(gpt(), config(accum=8, rampup_batch_size={"start": 2, "increment": 4, "samples": 8}))
    from tinyscale.train import make_spec
    with pytest.raises(ConfigError, match="rampup_batch_size is refused by tinyscale train"):  # fixed-size batches
        make_spec("single", config=config(accum=8, rampup_batch_size={"start": 2, "increment": 2, "samples": 8}))
    losses, final, sizes = _rampup_run(str(tmp_path / "c"), resume=False)
    # 3 increments of 4 samples: 2 rows until 4 trained, 4 until 8, 6 until 12, then 8
    assert sizes == [2, 2, 4, 6, 8, 8, 8]
    resumed, resumed_final, resumed_sizes = _rampup_run(str(tmp_path / "c"), resume=True)
    assert resumed_sizes == sizes and resumed == losses
    expected, state = reference(sizes)
    assert_losses_close(losses, expected, rtol=RTOL)
    assert_state_dicts_close(final, state, rtol=RTOL)
    assert_state_dicts_close(resumed_final, state, rtol=RTOL)


# --- the layout (and the batch) through a checkpoint ----------------------------------------------

LAYOUT_CHANGES = [  # (world, layout, batch, steps): dp 4 ZeRO 3 -> dp 2 x tp 2 ZeRO 1 with twice the batch
    (4, {"stage": 3}, 4, 2),
    (4, {"stage": 1, "parallel": {"tensor": 2}}, 8, 2),
]


def _layout_segment(path: str, index: int) -> tuple[list[float], dict]:
    _, layout, rows, steps = LAYOUT_CHANGES[index]
    dp = dist.get_world_size() // layout.get("parallel", {}).get("tensor", 1)
    engine = ts.initialize(gpt(), config(micro=1, accum=rows // dp, **layout))
    if index:
        engine.load_checkpoint(path)
    sizes = [r for _, _, r, n in LAYOUT_CHANGES for _ in range(n)]
    batches = batches_of(sizes)[engine.step:engine.step + steps]
    losses = [engine.train_batch(b) for b in batches]
    if index == 0:
        engine.save_checkpoint(path)
    return losses, engine.full_state_dict()


def test_layout_change_dp4_zero3_to_dp2_tp2_zero1_with_a_doubled_batch_continues_exactly(tmp_path):
    """Saved under dp 4 at ZeRO 3 after 2 steps of 4 rows; loaded under dp 2 x tp 2 at ZeRO 1 whose
    config's batch is 8: the losses and parameters equal one process fed 4, 4, 8, 8 rows, so
    AdamW's moments, the step count (mid warm-up) and the parameters crossed both changes.
    World-size and ZeRO-stage changes alone: tests/engine/test_dcp_checkpoint.py
    (4 -> 2 -> 1 -> 4 ranks, ZeRO 1 -> 0 -> 3 -> 3, tp, pp)."""
    losses = []
    for i, (world, *_rest) in enumerate(LAYOUT_CHANGES):
        got = run_on_ranks(_layout_segment, world, str(tmp_path / "ckpt"), i)
        losses += got[0][0]
    expected, state = reference([4, 4, 8, 8])
    assert_losses_close(losses, expected, rtol=RTOL)
    for _, final in got:
        assert_state_dicts_close(final, state, rtol=RTOL)
    assert not math.isclose(expected[2], expected[3])  # the steps did move the model
