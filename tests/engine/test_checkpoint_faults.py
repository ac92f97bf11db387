"""Checkpoints under faults (`pytest -k checkpoint_faults`): a save killed at any point leaves
a complete checkpoint (the old or the new), damaged files are refused with the file named,
and a config that cannot continue the checkpoint is refused with the difference named,
while deliberate hyperparameter changes are applied and reported."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil

import pytest
import torch

import tinyscale as ts
from tinyscale.data import synthetic_regression_batches
from tinyscale.engine import checkpoint_io
from tinyscale.engine.checkpoint import CheckpointError, CheckpointNotFound
from tinyscale.models import TinyMLP
from tinyscale.testing import run_on_ranks

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "betas": [0.9, 0.999]}}


def _config(optimizer=ADAMW, stage=0):
    return {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "optimizer": optimizer, "zero_optimization": {"stage": stage}}


BATCHES = synthetic_regression_batches(num_batches=3, batch_size=4, dim=8, seed=5)


def _trained(steps, **kw):
    engine = ts.initialize(TinyMLP(seed=0), _config(**kw))
    for batch in BATCHES[:steps]:
        engine.train_batch(batch)
    return engine


def _die_at(engine, path, point):
    def hook(reached):
        if reached == point:
            os._exit(86)  # a crash: no cleanup, no exception handlers, no atexit

    checkpoint_io.fault_hook = hook
    engine.save_checkpoint(path)
    os._exit(0)


def test_checkpoint_faults_a_save_killed_at_any_point_leaves_a_complete_checkpoint(tmp_path):
    """Kill the saving process at each point of a save (os._exit in a forked child); loading
    then returns the old checkpoint before the commit and the new one from it, verified."""
    engine = _trained(1)
    pristine, old_state = tmp_path / "pristine", engine.full_state_dict()
    engine.save_checkpoint(pristine)
    engine.train_batch(BATCHES[1])
    new_state = engine.full_state_dict()
    reached = []
    checkpoint_io.fault_hook = reached.append
    try:
        engine.save_checkpoint(tmp_path / "clean")
    finally:
        checkpoint_io.fault_hook = None
    assert tuple(reached) == checkpoint_io.POINTS  # the points a save passes, in order
    fork = multiprocessing.get_context("fork")
    for i, point in enumerate(checkpoint_io.POINTS):
        path = tmp_path / f"killed-at-{point}"
        shutil.copytree(pristine, path)
        child = fork.Process(target=_die_at, args=(engine, path, point))
        child.start()
        child.join(timeout=120)
        assert child.exitcode == 86, f"the save did not reach {point} (exit code {child.exitcode})"
        fresh = ts.initialize(TinyMLP(seed=9), _config())
        fresh.load_checkpoint(path)
        committed = i >= checkpoint_io.POINTS.index(checkpoint_io.COMMIT)
        assert fresh.step == (2 if committed else 1), f"killed at {point}"
        expected = new_state if committed else old_state
        assert all(torch.equal(fresh.full_state_dict()[k], v) for k, v in expected.items()), point
        # the next save collects what the killed one left behind
        fresh.save_checkpoint(path)
        assert sorted(p.name for p in path.iterdir()) == ["latest", checkpoint_io.live_version(path).name], point


def _damage_garbage_meta(live):
    (live / "meta.json").write_text('{"step": 3, "sha2')


def _damage_meta_without_sha256(live):
    meta = json.loads((live / "meta.json").read_text())
    del meta["sha256"]
    (live / "meta.json").write_text(json.dumps(meta))


def _damage_delete_shard(live):
    (live / "__0_0.distcp").unlink()


def _damage_truncate_shard(live):
    data = (live / "__0_0.distcp").read_bytes()
    (live / "__0_0.distcp").write_bytes(data[: len(data) // 2])


def _damage_delete_dcp_metadata(live):
    (live / ".metadata").unlink()


def _damage_delete_version(live):
    shutil.rmtree(live)


def _damage_garbage_pointer(live):
    (live.parent / "latest").write_text("../../etc\n")


DAMAGES = {
    "garbage-meta": (_damage_garbage_meta, r"meta\.json is not valid JSON"),
    "meta-without-sha256": (_damage_meta_without_sha256, r"meta\.json has no 'sha256' table"),
    "deleted-shard": (_damage_delete_shard, r"__0_0\.distcp is missing"),
    "truncated-shard": (_damage_truncate_shard, r"__0_0\.distcp is corrupt"),
    "deleted-dcp-metadata": (_damage_delete_dcp_metadata, r"\.metadata is missing"),
    "deleted-version": (_damage_delete_version, r"latest names v000001, but .* does not exist"),
    "garbage-pointer": (_damage_garbage_pointer, r"latest should name a version"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_checkpoint_faults_damaged_files_are_refused_naming_the_file(tmp_path, damage):
    _trained(1).save_checkpoint(tmp_path / "ckpt")
    spoil, message = DAMAGES[damage]
    spoil(checkpoint_io.live_version(tmp_path / "ckpt"))
    engine = ts.initialize(TinyMLP(seed=9), _config())
    before = engine.full_state_dict()
    with pytest.raises(CheckpointError, match=message) as info:
        engine.load_checkpoint(tmp_path / "ckpt")
    assert str(tmp_path / "ckpt") in str(info.value)  # the path is named
    assert "earlier checkpoint" in str(info.value) or "version" in str(info.value)  # and what to do
    assert engine.step == 0 and all(torch.equal(engine.full_state_dict()[k], v) for k, v in before.items())


def test_checkpoint_faults_missing_directory(tmp_path):
    engine = ts.initialize(TinyMLP(seed=9), _config())
    with pytest.raises(CheckpointNotFound, match="nowhere is not a checkpoint: it does not exist"):
        engine.load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFound, match="no 'latest' pointer, no meta.json"):
        engine.load_checkpoint(tmp_path / "empty")


def test_checkpoint_faults_another_optimizer_is_refused(tmp_path):
    """An AdamW checkpoint into an SGD engine (it used to load, then fail at the next step
    with KeyError 'momentum')."""
    _trained(1).save_checkpoint(tmp_path / "ckpt")
    for stage in (0, 2):
        sgd = ts.initialize(TinyMLP(seed=9), _config({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, stage))
        with pytest.raises(CheckpointError, match="holds AdamW's state, this engine steps with SGD"):
            sgd.load_checkpoint(tmp_path / "ckpt")
        sgd.train_batch(BATCHES[0])  # untouched: it still trains


class _Renamed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = TinyMLP(seed=0)

    def forward(self, *batch):
        return self.inner(*batch)


def test_checkpoint_faults_other_shapes_or_names_are_refused(tmp_path):
    _trained(1).save_checkpoint(tmp_path / "ckpt")
    wider = ts.initialize(TinyMLP(hidden=32, seed=0), _config())
    with pytest.raises(CheckpointError, match=r"shapes differ: fc_in.weight: saved \(16, 8\), here \(32, 8\)"):
        wider.load_checkpoint(tmp_path / "ckpt")
    renamed = ts.initialize(_Renamed(), _config())
    names = r"this model has \[.*'inner.fc_in.weight'.*\] which the checkpoint lacks\n  the checkpoint has \[.*'fc_in.weight'"
    with pytest.raises(CheckpointError, match=names):
        renamed.load_checkpoint(tmp_path / "ckpt")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("stage", [0, 2])
def test_checkpoint_faults_new_hyperparameters_win_and_are_reported(tmp_path, stage):
    """The new config's weight decay, betas and lr replace the saved param_groups' values
    (the optimizer state still comes from the file), and rank 0 logs each change."""
    saved = _trained(2, stage=stage)
    saved.save_checkpoint(tmp_path / "ckpt")
    changed = {"type": "AdamW", "params": {"lr": 5e-3, "weight_decay": 0.0, "betas": [0.8, 0.99]}}
    engine = ts.initialize(TinyMLP(seed=9), _config(changed, stage))
    records = _Records()
    logger = logging.getLogger("tinyscale.checkpoint")
    logger.addHandler(records)
    try:
        engine.load_checkpoint(tmp_path / "ckpt")
    finally:
        logger.removeHandler(records)
    for group in engine.optimizer.param_groups:
        assert group["weight_decay"] == 0.0 and tuple(group["betas"]) == (0.8, 0.99) and group["lr"] == 5e-3
    report = " ".join(records.messages)
    for change in ("optimizer.params.weight_decay: 0.1 -> 0.0", "optimizer.params.betas: [0.9, 0.999] -> [0.8, 0.99]",
                   "optimizer.params.lr: 0.01 -> 0.005"):
        assert change in report
    state = next(iter(engine.optimizer.state.values()))
    saved_state = next(iter(saved.optimizer.state.values()))
    assert torch.equal(state["exp_avg"], saved_state["exp_avg"])  # the state is the file's
    engine.train_batch(BATCHES[2])


def _load_where_rank1_cannot_read(path, stage):
    engine = ts.initialize(TinyMLP(seed=9), {**_config(stage=stage), "train_batch_size": 8})
    real = checkpoint_io.read_meta
    if torch.distributed.get_rank() == 1:  # e.g. a node whose mount of the checkpoint is stale
        checkpoint_io.read_meta = lambda p: (_ for _ in ()).throw(CheckpointError(f"rank 1 cannot read {p}"))
    try:
        engine.load_checkpoint(path)
        return None
    except CheckpointError as exc:
        return str(exc)
    finally:
        checkpoint_io.read_meta = real


@pytest.mark.parametrize("stage", [0, 3])
def test_checkpoint_faults_every_rank_raises_when_one_cannot_load(tmp_path, stage):
    """No rank goes on loading (stage 3 would wait in a gather forever) when another failed."""
    _trained(1).save_checkpoint(tmp_path / "ckpt")
    errors = run_on_ranks(_load_where_rank1_cannot_read, 2, str(tmp_path / "ckpt"), stage)
    assert errors[0] is not None and "rank 1 could not load" in errors[0] and "rank 1 cannot read" in errors[0]
    assert errors[1] is not None and errors[1].startswith("rank 1 cannot read")
