"""Compression through the engine on a model users bring, a step that raised, and a resume
(`pytest -k compression_user`).

The model (TinyMLP, odd sizes 5 and 7) has tied weights (`shared` used twice, `fc_in.weight`
in and out), a frozen layer, and a parameter no forward uses; weight decay is on, the world
is 3, buckets are small. Where compression is exact (top-k and random-k at ratio 1, PowerSGD
at full rank, 1-bit Adam in its warm-up) the engine must train as the uncompressed engine
does. A step whose last backward raised on every rank, then retried, and a checkpoint
resume must both equal a run that had neither, bit for bit, whatever the compressor.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tinyscale as ts
from tinyscale.data import synthetic_regression_batches
from tinyscale.engine import CheckpointError
from tinyscale.models import TinyMLP
from tinyscale.testing import run_on_ranks

MICRO, ACCUM, WORLD, STEPS = 2, 2, 3, 3


class UserModel(TinyMLP):
    """TinyMLP(5, 7) plus a parameter that never gets a gradient; raises in the backward of
    the micro-batch numbered `trap` (after the later layers' gradients, so buckets launched)."""

    def __init__(self):
        super().__init__(dim=5, hidden=7, seed=0)
        # no 0 in it: Adam on a gradient ~ 0 amplifies rounding
        self.unused = nn.Parameter(torch.linspace(0.1, 1.5, 10, dtype=torch.float64).view(2, 5))
        self.trap, self.calls, self.wake = None, 0, False  # wake: `unused` joins the loss

    def forward(self, x, y):
        self.calls += 1
        h = torch.tanh(self.fc_in(x))
        if self.trap == self.calls - 1:
            h.register_hook(lambda g: (_ for _ in ()).throw(MemoryError("simulated: backward")))
        h = torch.tanh(self.shared(torch.tanh(self.frozen(torch.tanh(self.shared(h))))))
        loss = torch.mean((h @ self.fc_in.weight + self.out_bias - y) ** 2)
        return loss + (self.unused ** 2).sum() * 10 if self.wake else loss  # large: top-k picks it


def _config(section: dict, bucket: int = 40) -> dict:
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {"train_batch_size": MICRO * ACCUM * world, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": ACCUM,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": {"reduce_bucket_size": bucket}, "compression": section}  # 40: several buckets


def _batches(steps: int = STEPS):
    return synthetic_regression_batches(num_batches=steps, batch_size=MICRO * ACCUM * WORLD, dim=5, seed=1)


def _train(section: dict, fail_at: int | None = None, path: str | None = None, resume_at: int | None = None,
           wake_at: int | None = None, steps: int = STEPS):
    """Losses and final parameters. fail_at: that step's last backward raises on every rank,
    then the step is retried. path/resume_at: save there after `resume_at` steps, and finish
    in a new engine that loaded it. wake_at: the unused parameter is used from that step on."""
    model = UserModel()
    engine = ts.initialize(model, _config(section))
    losses = []
    for step, batch in enumerate(_batches(steps)):
        model.wake = wake_at is not None and step >= wake_at
        if step == fail_at:
            model.trap = model.calls + ACCUM - 1
            with pytest.raises(MemoryError):
                engine.train_batch(batch)
            model.trap = None
        if step == resume_at:
            engine.save_checkpoint(path)
            model = UserModel()
            engine = ts.initialize(model, _config(section))
            engine.load_checkpoint(path)
        losses.append(engine.train_batch(batch))
    return losses, engine.full_state_dict()


# Exact configurations: each equals the uncompressed engine. Top-k/random-k at ratio 1 send
# every element; PowerSGD at rank 7 = min(n, m) of every matrix here (min_compression_rate 0:
# every matrix compressed) reconstructs the mean; 1-bit Adam before freeze_step is AdamW.
EXACT = {
    "topk": {"type": "topk", "ratio": 1.0}, "topk_no_feedback": {"type": "topk", "ratio": 1.0, "error_feedback": False},
    "randomk": {"type": "randomk", "ratio": 1.0},
    "randomk_no_feedback": {"type": "randomk", "ratio": 1.0, "error_feedback": False},
    "powersgd": {"type": "powersgd", "rank": 7, "min_compression_rate": 0},
    "powersgd_no_feedback": {"type": "powersgd", "rank": 7, "min_compression_rate": 0, "error_feedback": False},
    "onebit_adam": {"type": "onebit_adam", "freeze_step": 100},
}
# Lossy ones, for the failed step and the resume (each against itself uninterrupted).
LOSSY = {
    "topk": {"type": "topk", "ratio": 0.3}, "randomk": {"type": "randomk", "ratio": 0.3},
    "qsgd": {"type": "qsgd", "bits": 4}, "topk_no_feedback": {"type": "topk", "ratio": 0.3, "error_feedback": False},
    "powersgd": {"type": "powersgd", "rank": 2, "min_compression_rate": 0},
    "onebit_adam": {"type": "onebit_adam", "freeze_step": 1},
}


def _both(sections: dict, *args) -> dict:
    """Each section: (an uninterrupted run, the run `_train(section, *args)`)."""
    return {name: (_train(section), _train(section, *args)) for name, section in sections.items()}


def _assert_equal_runs(runs: dict) -> None:
    for name, ((losses, state), (ref_losses, ref_state)) in runs.items():
        assert losses == ref_losses, name
        assert all(torch.equal(state[k], ref_state[k]) for k in ref_state), name


def test_compression_user_failed_step_restores_the_hook_state():
    """Every rank runs the hooks of a step that is then dropped (the ranks that did not raise
    in their backward, the others in `complete_abandoned`): residuals, PowerSGD's memories and
    step count, random-k's and QSGD's streams must be put back. Found by this test: they were not."""
    for runs in run_on_ranks(_both, WORLD, LOSSY, 1):  # step 1's last backward raises, then is retried
        _assert_equal_runs(runs)


def test_compression_user_resume_equals_an_uninterrupted_run(tmp_path):
    """Residuals, PowerSGD's memories, 1-bit Adam's step count and errors are per rank and not
    in the optimizer's state: the checkpoint must hold them. Found by this test: it did not."""
    for runs in run_on_ranks(_both, WORLD, LOSSY, None, str(tmp_path / "ckpt"), 2):  # save after 2 steps
        _assert_equal_runs(runs)


def _load_on(section: dict, path: str, bucket: int = 40):
    ts.initialize(UserModel(), _config(section, bucket)).load_checkpoint(path)


def test_compression_user_resume_on_another_world_size_is_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on_ranks(_train, WORLD, LOSSY["topk"], None, path, 1)
    with pytest.raises(CheckpointError, match="per-rank compression state .* of 3 ranks and is loaded on 1"):
        _load_on(LOSSY["topk"], path)  # in this process: one rank


def test_compression_user_resume_with_other_powersgd_buckets_is_refused(tmp_path):
    """PowerSGD's memories are per bucket: other buckets would add them to the wrong gradients."""
    path = str(tmp_path / "ckpt")
    run_on_ranks(_train, WORLD, LOSSY["powersgd"], None, path, 3, None, 4)  # saved once PowerSGD has memories
    with pytest.raises(Exception, match="PowerSGD's memories are per bucket.*reduce_bucket_size"):
        run_on_ranks(_load_on, WORLD, LOSSY["powersgd"], path, 1000)


def _exact(sections: dict) -> dict:
    runs = {name: _train(section) for name, section in {"none": {"type": "none"}, **sections}.items()}
    # PowerSGD compresses from step 2; the parameter unused then is used from step 3
    for name in ("none", "powersgd", "powersgd_no_feedback"):
        runs[f"{name}_woken"] = _train({"type": "none"} if name == "none" else EXACT[name], wake_at=3, steps=4)
    return runs


def test_compression_user_exact_configurations_equal_the_uncompressed_engine():
    """Found by this test: 1-bit Adam stepped the parameter no rank used (decay, momentum) in
    its warm-up, where AdamW skips it; PowerSGD divided the unused parameter's zero P by its zero
    norm, and the NaN it kept (error, Q) reached that parameter once it was used."""
    runs = run_on_ranks(_exact, WORLD, EXACT)[0]
    truth = {False: runs.pop("none"), True: runs.pop("none_woken")}
    for name, (losses, state) in runs.items():
        ref_losses, ref_state = truth[name.endswith("_woken")]
        # 1e-10: float64, the same sums in another order (a compressor's decompress-and-add,
        # PowerSGD's P Q^T) over 3 steps; atol 1e-12 for entries near 0, where a relative bound is empty
        torch.testing.assert_close(losses, ref_losses, rtol=1e-10, atol=0, msg=name)
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], rtol=1e-10, atol=1e-12, msg=f"{name}: {k}")


def _residual_while_unused(section: dict):
    model = UserModel()
    engine = ts.initialize(model, _config(section))
    state = engine.ddp._comm_hook[0]
    kept = []
    for step, batch in enumerate(_batches()):
        model.wake = step != 1  # `unused` is used in steps 0 and 2, by no rank in step 1
        engine.train_batch(batch)
        kept.append(state.residuals[model.unused].clone())
    return kept


def test_compression_user_residual_of_a_parameter_no_rank_used_waits():
    """Error feedback sends nothing of a parameter's residual in a step where no rank used the
    parameter: DDP drops that parameter's averaged gradient, so what the hook sent of it would
    be lost. Found by this test: the residual shrank by what was sent, and that was dropped."""
    for kept in run_on_ranks(_residual_while_unused, WORLD, LOSSY["topk"]):
        assert kept[0].abs().sum() > 0  # top-k at 0.3 leaves some of it behind
        assert torch.equal(kept[1], kept[0])


def _powersgd_error_while_unused():
    model = UserModel()
    engine = ts.initialize(model, _config({**LOSSY["powersgd"], "rank": 1}))  # rank 1 < 2: lossy for `unused`
    b, i = engine.ddp.bucket_of(model.unused)
    start = engine.ddp.buckets[b].offsets[i]
    kept = []
    for step, batch in enumerate(_batches(5)):
        model.wake = step != 3  # PowerSGD compresses from step 2; no rank uses `unused` in step 3
        engine.train_batch(batch)
        kept.append(engine.ddp._comm_hook[0].errors.get(b, torch.zeros(start + 10))[start : start + 10].clone())
    return kept


def test_compression_user_powersgd_error_of_a_parameter_no_rank_used_waits():
    for kept in run_on_ranks(_powersgd_error_while_unused, WORLD):
        assert kept[2].abs().max() > 1e-3  # rank 1 leaves some of it behind
        assert torch.equal(kept[3], kept[2])
