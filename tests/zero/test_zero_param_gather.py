"""ZeRO stages 1 and 2 with Megatron's `overlap_param_gather` (`pytest -k overlap_param_gather`).

The step leaves its parameter all-gathers in flight; whoever reads the parameters before the
next forward must wait for them (tinyscale/zero/param_gather.py). The property: float64 on 3
ranks equals one process at rtol 1e-10 (tinyscale.testing) with 2 accumulated micro-batches,
clipping, weight decay, the model of `test_unused` (frozen, unused, data-dependent
parameters), and after each step a different first reader: ``model.state_dict()``, an
evaluation forward under ``no_grad`` (its values checked too), a checkpoint saved with
``torch.save``, the next training forward, a second ``step()`` without a forward. Ranks 1 and 2 start each step late, so
rank 0's gathers cannot have landed when it reads: without the wait it reads the parameters
of the step before (checked by removing the state-dict hooks, then the forward pre-hooks:
the test fails each time).
"""

from __future__ import annotations

import contextlib
import io
import time

import pytest
import torch
import torch.distributed as dist

from tests.zero.test_unused import UnusedMLP
from tests.zero.test_zero_overlap import one_process_step
from tinyscale.testing import assert_state_dicts_close, run_on_ranks, state_dict_cpu

WORLD, MICRO, ACCUM, STEPS = 3, 2, 2, 5
CLIP, LR, DECAY = 0.05, 1e-2, 0.05
LATE_S = 0.2  # ranks 1 and 2 start each step this late: rank 0 reads before its gathers can land


def _batches():
    gen = torch.Generator().manual_seed(5)
    out = []
    for step in range(STEPS + 1):  # the last: the evaluation batch
        x = torch.randn(WORLD * ACCUM * MICRO, 8, generator=gen, dtype=torch.float64).clamp(-3, 3)
        x[[2, 7 + step % 4], 0] = 10.0  # rows that use `extra`: some ranks' micro-batches only
        out.append((x, torch.randn(x.shape, generator=gen, dtype=torch.float64)))
    return out


def _rows(rank: int, micro: int) -> slice:
    start = (rank * ACCUM + micro) * MICRO
    return slice(start, start + MICRO)


def _read(step: int, model, zero, eval_batch) -> tuple[dict, float | None]:
    """After step `step`: each step a different first reader of the parameters."""
    loss = None
    if step == 1:  # an evaluation forward: the modules' pre-hooks wait
        model.eval()
        with torch.no_grad():
            loss = model(*eval_batch).item()
        model.train()
    if step == 2:  # a checkpoint: torch.save of the state dict, read back
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        buffer.seek(0)
        return torch.load(buffer), loss
    if step == 3:  # none: the next training forward reads first (its modules' pre-hooks wait)
        return {}, loss
    if step == 4:  # a second step with no forward between: nothing to step, the gathers again
        zero.step(max_norm=CLIP)
        loss = len(zero.sharded._gathers or {})  # (left in flight: what the state dict waits for)
    return state_dict_cpu(model), loss


def _train(stage: int, pieces: int | None):
    from tinyscale.zero import ZeroStage1, ZeroStage2

    rank, model = dist.get_rank(), UnusedMLP(seed=0)
    make = lambda groups: torch.optim.AdamW(groups, lr=LR, weight_decay=DECAY)  # noqa: E731
    params = [p for p in model.parameters() if p.requires_grad]
    zero = (ZeroStage1 if stage == 1 else ZeroStage2)(params, make, bucket_bytes=8 * 150, first_bucket_bytes=8 * 40,
                                                      overlap_param_gather=True, module=model)
    zero.sharded.gather_piece_numel = pieces
    batches, states, losses = _batches(), [], []
    for step, (x, y) in enumerate(batches[:STEPS]):
        for micro in range(ACCUM):
            with zero.no_sync() if stage == 1 and micro < ACCUM - 1 else contextlib.nullcontext():
                (model(x[_rows(rank, micro)], y[_rows(rank, micro)]) / ACCUM).backward()
        if rank != 0:
            time.sleep(LATE_S)
        zero.step(max_norm=CLIP)
        state, loss = _read(step, model, zero, batches[STEPS])
        states.append(state)
        losses.append(loss)
    return states, losses


def _one_process():
    model = UnusedMLP(seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=DECAY)
    batches, states, losses = _batches(), [], []
    for step, (x, y) in enumerate(batches[:STEPS]):
        one_process_step(model, params, opt, x, y, _rows, WORLD, ACCUM, CLIP)
        states.append(state_dict_cpu(model))
        with torch.no_grad():
            losses.append(model(*batches[STEPS]).item() if step == 1 else None)
    return states, losses


@pytest.mark.parametrize(("stage", "pieces"), [(1, None), (2, 16)], ids=["zero1", "zero2_pieces"])
def test_zero1_zero2_overlap_param_gather_readers_after_step_wait_float64(stage, pieces):
    """Every state read right after a step (state dict, evaluation, checkpoint, second step) is
    the one process's after that step, at rtol 1e-10; stage 2 gathers in pieces of 16 elements."""
    states, losses = _one_process()
    for rank, (got, got_losses) in enumerate(run_on_ranks(_train, WORLD, stage, pieces)):
        for step, (a, b) in enumerate(zip(got, states)):
            if step != 3:  # (after step 3 the next forward is the reader: step 4's state checks it)
                assert_state_dicts_close(a, b, what=f"zero{stage} rank {rank} after step {step}")
        assert got_losses[1] == pytest.approx(losses[1], rel=1e-10)  # float64: rounding only
        assert got_losses[4] > 0  # gathers were in flight after the second step


def test_zero2_overlap_param_gather_needs_the_module():
    from tinyscale.zero import ZeroStage2

    model = UnusedMLP(seed=0)
    make = lambda groups: torch.optim.AdamW(groups, lr=LR)  # noqa: E731
    with pytest.raises(ValueError, match="module"):
        ZeroStage2(model.parameters(), make, overlap_param_gather=True)
    with pytest.raises(ValueError, match="not owned"):  # a parameter outside `module`: no hook would wait for it
        ZeroStage2([*model.fc_in.parameters(), *model.shared.parameters()], make, overlap_param_gather=True,
                   module=model.fc_in)
