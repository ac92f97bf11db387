"""A step that raised leaves the engine exactly as it was before it (`pytest -k failed_step`).

A forward or backward raises midway on one rank (or on all), at every stage, with gradient
accumulation, at world sizes 1 and 2. The rank that raised re-raises its error; the others
raise `StepFailed` naming it; nobody hangs (the failing rank makes the collectives the
others make in the rest of the step). Then the same batch is retried and training goes on:
losses and parameters must equal, bit for bit, those of a run in which nothing failed.
A non-finite loss drops the step the same way (FloatingPointError on every rank).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.data import synthetic_regression_batches
from tinyscale.models import TinyMLP
from tinyscale.testing import run_on_ranks

MICRO, ACCUM = 2, 2


class Flaky(TinyMLP):
    """TinyMLP that raises MemoryError in the forward, or midway through the backward (after
    the last layers' gradients are in), of the micro-batch given by `trap = (where, call)`."""

    def __init__(self):
        super().__init__(seed=0)
        self.trap, self.calls = None, 0

    def forward(self, x, y):
        self.calls += 1
        where = self.trap[0] if self.trap and self.trap[1] == self.calls - 1 else None
        if where == "forward":
            raise MemoryError("simulated: forward")
        h = torch.tanh(self.fc_in(x))
        if where == "backward":  # fires once backward reaches fc_in's output: later layers are done
            h.register_hook(lambda g: (_ for _ in ()).throw(MemoryError("simulated: backward")))
        h = torch.tanh(self.shared(torch.tanh(self.frozen(torch.tanh(self.shared(h))))))
        return torch.mean((h @ self.fc_in.weight + self.out_bias - y) ** 2)


# step -> (ranks that fail, where, micro-batch): one rank or all; forward or backward; first or last
FAILURES = {1: ("one", "forward", 1), 2: ("one", "backward", 0), 3: ("all", "backward", 1), 4: ("nan", None, 0)}
STEPS = 6


def _run(stage, fail):
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    config = {"train_batch_size": MICRO * ACCUM * world, "train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": ACCUM, "gradient_clipping": 0.05,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 200}}  # several buckets
    model = Flaky()
    engine = ts.initialize(model, config, **({"zero3_wrap": ["shared"]} if stage == 3 else {}))
    batches = synthetic_regression_batches(num_batches=STEPS, batch_size=MICRO * ACCUM * world, dim=8, seed=1)
    losses, raised = [], []
    for step, batch in enumerate(batches):
        who, where, micro = FAILURES.get(step, (None, None, 0)) if fail else (None, None, 0)
        if who == "nan":
            x = batch[0].clone()
            x[-1, 0] = float("nan")  # the last rank's last row
            bad = (x, batch[1])
        if who in ("one", "all"):
            model.trap = (where, model.calls + micro) if who == "all" or rank == world - 1 else None
        if who is not None:
            with pytest.raises(Exception) as info:
                engine.train_batch(bad if who == "nan" else batch)
            raised.append(type(info.value).__name__)
            model.trap = None
        losses.append(engine.train_batch(batch))  # the retry, or the only try
    return losses, engine.full_state_dict(), raised, engine.step


def _launch(world, *args):
    return run_on_ranks(_run, world, *args) if world > 1 else [_run(*args)]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3], ids=["zero0", "zero1", "zero2", "zero3"])
def test_failed_step_leaves_the_engine_as_before(stage, world):
    failing = _launch(world, stage, True)
    straight = _launch(world, stage, False)
    for rank, ((losses, state, raised, steps), (ref_losses, ref_state, _, _)) in enumerate(zip(failing, straight)):
        assert losses == ref_losses and steps == STEPS
        assert all(torch.equal(state[k], ref_state[k]) for k in ref_state), "parameters differ from a run without failures"
        last = rank == world - 1  # the rank that fails alone
        assert raised == ["MemoryError" if last or world == 1 else "StepFailed", "MemoryError" if last else "StepFailed",
                          "MemoryError", "FloatingPointError"]


@pytest.mark.parametrize("stage", [0, 2], ids=["zero0", "zero2"])
def test_failed_step_in_the_optimizer_stops_the_engine(stage):
    """Past backward there is no way back (parameters may be partly updated): the engine says so."""
    engine = ts.initialize(Flaky(), {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}})
    batch = synthetic_regression_batches(num_batches=1, batch_size=2, dim=8, seed=1)[0]
    optimizer = engine.zero.sharded.optimizer if stage else engine.optimizer
    optimizer.step = lambda *a, **k: (_ for _ in ()).throw(OSError("simulated: disk full"))
    with pytest.raises(OSError, match="disk full"):
        engine.train_batch(batch)
    with pytest.raises(RuntimeError, match=r"cannot continue: step 0 raised in the optimizer step \(OSError"):
        engine.train_batch(batch)
