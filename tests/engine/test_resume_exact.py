"""Exact resume: a run interrupted, saved and resumed by a fresh engine equals the uninterrupted
run bit for bit, dropout's random draws included (`pytest -k resume_exact`).

The GPT trains with dropout 0.1 in float64. Every rank seeds its generator differently, so
the dropout masks differ per rank, and the resumed process starts with other generators and
another initialisation: losses and parameters can only match if the checkpoint carries
every rank's random state, the optimizer state, the step and the schedule's position.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.engine import checkpoint
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import run_on_ranks
from tinyscale.train import compare_with_reference, make_spec, train_rank

CFG = GPTConfig(vocab_size=256, max_seq_len=8, n_layer=2, n_head=5, d_model=20, ffn_hidden=36, dropout=0.1)
STEPS, SAVE_AT, MICRO = 4, 2, 2


def _config(stage, world, accum, fp16=False):
    config = {"train_batch_size": MICRO * accum * world, "train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": accum, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": STEPS}},
              "zero_optimization": {"stage": stage}}
    if fp16:  # a small initial scale that grows every step: the scaler's state changes at each step
        config["fp16"] = {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 1}
    return config


def _run(path, stage, accum, mode, fp16=False):
    """mode "straight": STEPS steps; "first": SAVE_AT steps, then save; "resume": load, finish."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    # Each rank draws its own dropout masks; the resumed run's generators and weights are
    # deliberately others: all it continues with must come from the file.
    torch.manual_seed(1000 + rank if mode != "resume" else 7)
    random.seed(rank if mode != "resume" else 7)
    model = GPT(CFG, seed=0 if mode != "resume" else 1, dtype=torch.float64)
    batches = synthetic_token_batches(num_batches=STEPS, batch_size=MICRO * accum * world, seq_len=8, seed=3)
    engine = ts.initialize(model, _config(stage, world, accum, fp16))
    if mode == "resume":
        engine.load_checkpoint(path)
    losses = [engine.train_batch(batches[s]) for s in range(engine.step, SAVE_AT if mode == "first" else STEPS)]
    if mode == "first":
        engine.save_checkpoint(path)
    scaler = engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None
    return losses, engine.full_state_dict(), scaler, random.random()


def _launch(world, *args):
    return run_on_ranks(_run, world, *args) if world > 1 else [_run(*args)]


def _check_resumes_exactly(tmp_path, stage, world, accum, fp16=False):
    path = str(tmp_path / "ckpt")
    straight = _launch(world, path, stage, accum, "straight", fp16)
    _launch(world, path, stage, accum, "first", fp16)
    resumed = _launch(world, path, stage, accum, "resume", fp16)
    for rank, ((losses, state, scaler, draw), (losses2, state2, scaler2, draw2)) in enumerate(zip(straight, resumed)):
        assert losses2 == losses[SAVE_AT:], f"rank {rank}: losses after resuming differ"
        for key, value in state.items():
            assert torch.equal(state2[key], value), f"rank {rank}: {key} differs after resuming"
        assert scaler2 == scaler, f"rank {rank}: loss scaler state differs"
        assert draw2 == draw, f"rank {rank}: Python's random generator was not restored"


@pytest.mark.parametrize(("stage", "world", "accum"), [(0, 2, 1), (1, 2, 1), (2, 2, 1), (3, 2, 1), (2, 3, 2),
                                                       (0, 1, 2)],
                         ids=["ddp-x2", "zero1-x2", "zero2-x2", "zero3-x2", "zero2-x3-accum2", "one-process-accum2"])
def test_resume_exact_with_dropout(tmp_path, stage, world, accum):
    _check_resumes_exactly(tmp_path, stage, world, accum)


def test_resume_exact_fp16_loss_scaler(tmp_path):
    # the scale grows every step (window 1), so a scaler restarted from its initial state differs
    _check_resumes_exactly(tmp_path, 1, 2, 1, fp16=True)


def test_resume_exact_other_world_size_is_defined():
    """Loading on more ranks than saved: saved ranks keep their state, a new rank derives one
    deterministically (distinct from every saved rank's), and a warning says masks differ."""
    device = torch.device("cpu")
    saved = {"world_size": 2, "ranks": {}}
    for r in range(2):
        torch.manual_seed(100 + r)
        saved["ranks"][r] = checkpoint.rng_state(device)
    assert checkpoint.restore_rng(saved, 1, 2, device) is None  # same world: exact, silent
    assert torch.equal(torch.get_rng_state(), saved["ranks"][1]["torch"])
    warning = checkpoint.restore_rng(saved, 2, 3, device)
    assert "written by 2 ranks and is loaded on 3" in warning and "dropout masks" in warning
    derived = torch.get_rng_state()
    checkpoint.restore_rng(saved, 2, 3, device)
    assert torch.equal(torch.get_rng_state(), derived)  # deterministic
    assert not any(torch.equal(derived, s["torch"]) for s in saved["ranks"].values())
    checkpoint.restore_rng(saved, 3, 4, device)
    assert not torch.equal(torch.get_rng_state(), derived)  # distinct per rank


def test_resume_exact_cli_continues_from_the_saved_batch(tmp_path):
    """`tinyscale train --save-dir D` then `--resume --steps more`: the resumed run starts at
    the saved data position and ends where an uninterrupted run ends."""
    common = {"preset": "single", "model": "tiny", "dtype": "float64"}

    def run(steps, **kw):
        spec = dataclasses.replace(make_spec(steps=steps, **common, **kw), show_progress=False)
        return spec, train_rank(spec)

    _, straight = run(3)
    run(2, save_dir=str(tmp_path / "ck"))
    spec, resumed = run(3, save_dir=str(tmp_path / "ck"), resume=True)
    assert [m["step"] for m in resumed["metrics"]] == [2]
    assert resumed["metrics"][0]["loss"] == straight["metrics"][2]["loss"]
    assert all(torch.equal(resumed["state"][k], v) for k, v in straight["state"].items())
    # against one process, step by step: float64 rounding is ~1e-15; a step off by one differs by ~1e-2
    assert compare_with_reference(spec, resumed, show_progress=False)["max_loss_diff"] < 1e-12
    with pytest.raises(ValueError, match="--seed 0"):
        make_spec(steps=3, **common, seed=1, save_dir=str(tmp_path / "ck"), resume=True)
    with pytest.raises(ValueError, match="nothing to train"):
        make_spec(steps=3, **common, save_dir=str(tmp_path / "ck"), resume=True)
