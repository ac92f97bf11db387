"""Checkpoints: resuming is bit-for-bit, loads work across layouts, writes are atomic, corruption is caught."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.data import synthetic_regression_batches
from tinyscale.engine import checkpoint, checkpoint_io
from tinyscale.models import TinyMLP
from tinyscale.testing import assert_state_dicts_close, run_on_ranks

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 6}}}


def _batches(world_size, steps=6):
    rows = ts.EngineConfig.load(CONFIG).batch(world_size).train_batch_size
    return synthetic_regression_batches(num_batches=steps, batch_size=rows, dim=8, seed=5)


def _train(engine, batches):
    return [engine.train_batch(b) for b in batches]


def test_checkpoint_resume_is_bit_for_bit(tmp_path):
    batches = _batches(1)
    straight = ts.initialize(TinyMLP(seed=0), CONFIG)
    losses = _train(straight, batches)

    first = ts.initialize(TinyMLP(seed=0), CONFIG)
    _train(first, batches[:3])
    first.save_checkpoint(tmp_path / "ckpt")
    resumed = ts.initialize(TinyMLP(seed=99), CONFIG)  # different init: everything must come from the file
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step == 3
    assert _train(resumed, batches[3:]) == losses[3:]
    for key, value in straight.full_state_dict().items():
        assert torch.equal(resumed.full_state_dict()[key], value), key


def _save_after_half(path, steps_before):
    world = dist.get_world_size()
    engine = ts.initialize(TinyMLP(seed=0), CONFIG)
    _train(engine, _batches(world)[:steps_before])
    engine.save_checkpoint(path)
    return engine.full_state_dict()


def _resume_and_finish(path, saved_world):
    # Batches are global: a 3-rank job continues on the rows a 2-rank job would have seen
    # only if the global batch size is the same, so both use train_batch_size of saved_world.
    rows = ts.EngineConfig.load(CONFIG).batch(saved_world).train_batch_size
    world = dist.get_world_size()
    config = {**CONFIG, "train_batch_size": rows, "train_micro_batch_size_per_gpu": rows // world,
              "gradient_accumulation_steps": 1}
    engine = ts.initialize(TinyMLP(seed=1), config)
    engine.load_checkpoint(path)
    return _train(engine, _batches(saved_world)[3:]), engine.full_state_dict()


@pytest.mark.parametrize("save_world, load_world", [(2, 4), (4, 2), (2, 1)])
def test_checkpoint_loads_across_layouts(tmp_path, save_world, load_world):
    path = str(tmp_path / "ckpt")
    run_on_ranks(_save_after_half, save_world, path, 3)
    if load_world == 1:
        results = [_resume_and_finish_single(path, save_world)]
    else:
        results = run_on_ranks(_resume_and_finish, load_world, path, save_world)
    model = TinyMLP(seed=0)
    ref_losses = ts.reference.train(model, _batches(save_world), CONFIG)
    for losses, state in results:
        assert losses == pytest.approx(ref_losses[3:], rel=1e-10)
        assert_state_dicts_close(state, model.state_dict())


def _resume_and_finish_single(path, saved_world):
    rows = ts.EngineConfig.load(CONFIG).batch(saved_world).train_batch_size
    config = {**CONFIG, "train_batch_size": rows, "train_micro_batch_size_per_gpu": rows,
              "gradient_accumulation_steps": 1}
    engine = ts.initialize(TinyMLP(seed=1), config)
    engine.load_checkpoint(path)
    return _train(engine, _batches(saved_world)[3:]), engine.full_state_dict()


def test_checkpoint_interrupted_write_keeps_the_previous_one(tmp_path, monkeypatch):
    engine = ts.initialize(TinyMLP(seed=0), CONFIG)
    _train(engine, _batches(1)[:1])
    engine.save_checkpoint(tmp_path / "ckpt")
    _train(engine, _batches(1)[1:2])
    real_save = torch.save
    calls = []

    def dying_save(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) == 2:  # the second item DCP writes: die mid-checkpoint
            raise OSError("disk full (simulated)")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        engine.save_checkpoint(tmp_path / "ckpt")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no debris
    fresh = ts.initialize(TinyMLP(seed=3), CONFIG)
    fresh.load_checkpoint(tmp_path / "ckpt")
    assert fresh.step == 1  # the previous, complete checkpoint


def test_checkpoint_corruption_and_mismatch_are_clear_errors(tmp_path):
    engine = ts.initialize(TinyMLP(seed=0), CONFIG)
    engine.save_checkpoint(tmp_path / "ckpt")
    with open(checkpoint_io.live_version(tmp_path / "ckpt") / "__0_0.distcp", "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xfe")
    with pytest.raises(ValueError, match="__0_0.distcp is corrupt"):
        engine.load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        engine.load_checkpoint(tmp_path / "nothing")
    engine.save_checkpoint(tmp_path / "small")
    bigger = ts.initialize(TinyMLP(dim=8, hidden=32, seed=0), CONFIG)
    with pytest.raises((ValueError, RuntimeError), match="size mismatch|does not fit"):
        bigger.load_checkpoint(tmp_path / "small")


def test_checkpoint_optimizer_state_round_trips_by_name():
    model = TinyMLP(seed=0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(*synthetic_regression_batches(num_batches=1, batch_size=4, dim=8, seed=0)[0]).backward()
    opt.step()
    names = {p: n for n, p in model.named_parameters()}
    saved = checkpoint.optimizer_state_by_name(opt, names)
    assert set(saved["state"]) == {n for n, p in model.named_parameters() if p.requires_grad}
    opt2 = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    checkpoint.load_optimizer_state_by_name(opt2, saved, dict(model.named_parameters()))
    for p in opt.state:
        for k, v in opt.state[p].items():
            assert torch.equal(opt2.state[p][k], v)
