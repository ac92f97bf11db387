"""ZeRO checkpoints: saved by parameter name, so they resume bit-for-bit in the same layout
and load into any stage and world size (`pytest -k zero_checkpoint`; ids name the stages)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tests.zero.test_zero_stages import OPTIMIZERS, _setup, no_decay_on_biases
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks

ROWS, STEPS, SAVE_AT = 24, 4, 2  # 24 rows: 2 micro-batches on each of 1-4 ranks


def _config(stage, world, offload="none", path=None):
    zero = {"stage": stage, "reduce_bucket_size": 400}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "nvme_path": path}
    return {"train_batch_size": ROWS, "train_micro_batch_size_per_gpu": ROWS // world // 2,
            "gradient_accumulation_steps": 2, "gradient_clipping": 0.05, "optimizer": OPTIMIZERS["adamw"],
            "zero_optimization": zero,
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 1, "total_num_steps": STEPS}}}


def _run(path, stage, offload, save, load, seed):
    """Train (loading from `path` first if `load`), saving at SAVE_AT if `save`; every rank."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    model, _ = _setup("gpt", seed, ROWS, STEPS)
    batches = _setup("gpt", 0, ROWS, STEPS)[1]  # the same data whatever the initialisation
    engine = ts.initialize(model, _config(stage, world, offload, path + "-swap"), param_groups=no_decay_on_biases)
    if load:
        engine.load_checkpoint(path)
    losses = []
    for step in range(engine.step, STEPS):
        losses.append(engine.train_batch(batches[step]))
        if save and step + 1 == SAVE_AT:
            engine.save_checkpoint(path)
    return losses, engine.full_state_dict()


def _launch(world, *args):
    return run_on_ranks(_run, world, *args) if world > 1 else [_run(*args)]


@pytest.mark.parametrize(("stage", "world", "offload"), [(1, 2, "none"), (2, 3, "nvme"), (3, 2, "none"),
                                                         (3, 3, "nvme")],
                         ids=["zero1", "zero2-nvme", "zero3", "zero3-nvme"])
def test_zero_checkpoint_resumes_bit_for_bit(tmp_path, stage, world, offload):
    path = str(tmp_path / "ckpt")
    straight = _launch(world, path, stage, offload, True, False, 0)  # saves at SAVE_AT, trains on
    resumed = _launch(world, path, stage, offload, False, True, 1)  # another init: all from the file
    for (losses, state), (resumed_losses, resumed_state) in zip(straight, resumed):
        assert resumed_losses == losses[SAVE_AT:]
        assert all(torch.equal(resumed_state[k], state[k]) for k in state)


@pytest.mark.parametrize(("save", "load"), [((3, 2), (1, 3)), ((1, 4), (3, 3)), ((2, 3), (0, 2)),
                                             ((0, 2), (2, 4)), ((3, 4), (0, 1))],
                         ids=["zero3x2-to-zero1x3", "zero1x4-to-zero3x3", "zero2x3-to-ddp-x2",
                              "ddp-x2-to-zero2x4", "zero3x4-to-one-process"])
def test_zero_checkpoint_loads_across_stages_and_world_sizes(tmp_path, save, load):
    path = str(tmp_path / "ckpt")
    _launch(save[1], path, save[0], "none", True, False, 0)
    results = _launch(load[1], path, load[0], "none", False, True, 1)
    model, batches = _setup("gpt", 0, ROWS, STEPS)
    ref = ts.reference.train(model, batches, _config(0, 1), param_groups=no_decay_on_biases)
    for losses, state in results:
        assert_losses_close(losses, ref[SAVE_AT:])
        assert_state_dicts_close(state, model.state_dict(), what="after resuming in another layout")
