"""Pipeline parallelism: stage partitioning, schedules as data, a simulator and a renderer.

- `schedules.py`: AFAB (GPipe), 1F1B, interleaved 1F1B and ZB-H1 as pure functions returning
  each rank's list of `Action`s, and `add_communication`, the one lowering pass adding sends
  and receives.
- `simulator.py`: runs any lowered schedule on unit or given costs; checks dependencies,
  detects deadlock, measures makespan, bubble fraction and peak in-flight micro-batches.
- `render.py`: a schedule as a text table or a matplotlib Gantt chart.
- `replay.py`: times an executor's steps (each action, each message's hold) and replays each
  step in the simulator on its own costs, beside the measured bubble.
- `partition.py`: which GPT layers go to which stage (and chunk).
- `executor.py`: one executor running any lowered schedule on a rank's GPT stages.

The tests: `pytest tests/pipeline` (keys pp_simulator, pp_afab, pp_1f1b, pp_interleaved,
pp_zero_bubble, pp_partition, pp_executor).
"""

from tinyscale.pipeline.executor import GPTStage, PipelineExecutor, exchange_tied_grads, gpt_loss
from tinyscale.pipeline.partition import StageLayers, balanced_split, partition_gpt, stages_on_rank
from tinyscale.pipeline.schedules import (
    Action,
    add_communication,
    afab,
    format_schedule,
    interleaved_1f1b,
    one_f_one_b,
    stage_ranks,
    zb_h1,
)
from tinyscale.pipeline.simulator import ScheduleError, Simulation, simulate

__all__ = [
    "Action",
    "GPTStage",
    "PipelineExecutor",
    "ScheduleError",
    "Simulation",
    "StageLayers",
    "add_communication",
    "afab",
    "balanced_split",
    "exchange_tied_grads",
    "format_schedule",
    "gpt_loss",
    "interleaved_1f1b",
    "one_f_one_b",
    "partition_gpt",
    "simulate",
    "stage_ranks",
    "stages_on_rank",
    "zb_h1",
]
