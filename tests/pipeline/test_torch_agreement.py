"""Our executor against PyTorch's torch.distributed.pipelining on the same stages and batch:
ScheduleGPipe vs afab, Schedule1F1B vs one_f_one_b, ScheduleInterleaved1F1B vs interleaved_1f1b,
2 ranks, float64, one step's gradients (torch scales them by 1/m after accumulating, we scale
each loss by 1/m before its backward: the same sum up to rounding, rtol 1e-10).
Run: `pytest tests/pipeline -k pp_executor_agrees`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.pipeline.test_executor import SCHEDULES, _setup
from tinyscale.pipeline.executor import GPTStage, PipelineExecutor, gpt_loss
from tinyscale.pipeline.partition import partition_gpt, stages_on_rank
from tinyscale.pipeline.schedules import add_communication
from tinyscale.testing import assert_state_dicts_close, run_on_ranks

TORCH_SCHEDULES = {"afab": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


def one_step_grads(name, impl, n_layer, m, v):
    import torch.distributed.pipelining as pipelining

    p, rank = dist.get_world_size(), dist.get_rank()
    model, batches = _setup(n_layer, False, 2 * m, 1)
    inputs, targets = batches[0]
    specs = stages_on_rank(partition_gpt(model.config, p, virtual_stages=v), rank)
    modules = {spec.stage: GPTStage(model, spec) for spec in specs}
    if impl == "ours":
        executor = PipelineExecutor(add_communication(SCHEDULES[name](p, m, v)), rank, modules, loss_fn=gpt_loss)
        executor.run(inputs.chunk(m), targets.chunk(m))
    else:
        stages = [pipelining.PipelineStage(modules[s.stage], s.stage, p * v, torch.device("cpu")) for s in specs]
        schedule_class = getattr(pipelining, TORCH_SCHEDULES[name])
        schedule = schedule_class(stages if name == "interleaved_1f1b" else stages[0], m, loss_fn=gpt_loss)
        kwargs = {"target": targets, "losses": []} if rank == p - 1 else {}
        if rank == 0:
            schedule.step(inputs, **kwargs)
        else:
            schedule.step(**kwargs)
    mine = {id(q) for mod in modules.values() for q in mod.parameters()}
    return {k: q.grad.clone() for k, q in model.named_parameters() if id(q) in mine}


@pytest.mark.parametrize(("name", "n_layer", "m", "v"), [("afab", 3, 3, 1), ("1f1b", 3, 4, 1),
                                                         ("interleaved_1f1b", 5, 4, 2)])
def test_pp_executor_agrees_with_torch_pipelining(name, n_layer, m, v):
    ours = run_on_ranks(one_step_grads, 2, name, "ours", n_layer, m, v)
    theirs = run_on_ranks(one_step_grads, 2, name, "torch", n_layer, m, v)
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys() and a
        assert_state_dicts_close(a, b, what=f"{name}: ours vs torch.distributed.pipelining")
