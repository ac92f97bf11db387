"""A step that raised on one pipeline stage only is dropped on every stage (`pytest -k pipeline_failed_step`).

The last stage's loss raises (its peer waits for the gradient it would send), or the first
stage's last backward raises after its last send (its peer gets no message saying so): every rank
finishes the schedule, agrees on who failed, drops the step within seconds (the rank that
raised re-raises its error, the others raise `StepFailed` naming it), and the retried batches
train like `tinyscale.reference.train` (float64, rtol 1e-10).
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

import tinyscale as ts
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks

from tests.engine.test_engine_pipeline import CLIP, batches, gpt, run_config


def _one_stage_raises_body():
    """pp 2, 1F1B, m 2: step 0's loss raises on the last stage only (micro-batch 1: rank 0 then
    waits for its gradient); step 1's last backward raises on the first stage only (after its
    last send, so rank 1 gets no message saying so). Each batch is retried."""
    engine = ts.initialize(gpt(3, True), run_config(2, 1, "1f1b", 2, "adamw", clip=CLIP))
    executor, rank, calls = engine.pipeline.executor, dist.get_rank(), {"loss": 0, "forward": 0}
    loss_fn = executor.loss_fn

    def flaky_loss(logits, targets):
        calls["loss"] += 1
        if calls["loss"] == 2:
            raise MemoryError("simulated: loss")
        return loss_fn(logits, targets)

    def throw(grad):
        raise MemoryError("simulated: backward")

    def flaky_forward(module, args, out):
        calls["forward"] += 1
        if calls["forward"] == 6:  # step 0: 2 (failed) + 2 (retry); step 1: the second micro-batch
            out.register_hook(throw)  # fires in its backward, the last action on rank 0
    executor.loss_fn = flaky_loss
    if rank == 0:
        engine.pipeline.stages[0].register_forward_hook(flaky_forward)
    losses, raised = [], []
    for step, batch in enumerate(batches(2, steps=3)):
        if step < 2:
            start = time.perf_counter()
            with pytest.raises(Exception) as info:
                engine.train_batch(batch)
            raised.append((type(info.value).__name__, str(info.value), time.perf_counter() - start))
        losses.append(engine.train_batch(batch))
    return losses, engine.full_state_dict(), raised, engine.step


def test_engine_pipeline_failed_step_on_one_stage_is_dropped_on_every_stage():
    """Found by an audit: a stage that raised left its peers waiting for its messages until the
    process-group timeout, and the engine refused every later step. Now the schedule runs to its
    end on every stage (a failed stage sends messages saying so instead of its tensors), all
    agree, and every rank drops the step: the retries train like one process."""
    model = gpt(3, True)
    expected_losses = ts.reference.train(model, batches(2, steps=3),
                                         run_config(1, 1, "1f1b", 2, "adamw", clip=CLIP) | {"parallel": {}})
    results = run_on_ranks(_one_stage_raises_body, 2, timeout_s=30)
    for rank, (losses, state, raised, steps) in enumerate(results):
        assert_losses_close(losses, expected_losses)
        assert_state_dicts_close(state, model.state_dict(), what=f"rank {rank} after two dropped steps")
        assert steps == 3
        culprits = [1, 0]  # step 0: the last stage's loss; step 1: the first stage's backward
        for (kind, message, seconds), culprit in zip(raised, culprits):
            assert kind == ("MemoryError" if rank == culprit else "StepFailed"), message
            assert rank == culprit or f"[{culprit}]" in message, message
            assert seconds < 10, f"rank {rank} waited {seconds:.1f} s for a failed stage"  # not a timeout
