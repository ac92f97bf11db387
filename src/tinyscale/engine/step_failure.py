"""A step that raised on some ranks: who failed, agreed over the world, and what the others raise.

Both the data-parallel step (`engine/engine.py`) and the pipeline's (`engine/pipeline_step.py`)
use these, so neither imports the other. Tests: `pytest -k failed_step`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tinyscale.dist import comm


class StepFailed(RuntimeError):
    """Another rank's forward or backward raised; every rank dropped the step (retry or skip it)."""


def failed_ranks(failed_here: bool, device: torch.device) -> list[int]:
    """The global ranks whose forward or backward raised this step, agreed over the whole world
    (one all-reduce of a flag per rank): under tensor or pipeline parallelism a rank's failure
    must stop its TP and pp peers as well as its dp peers, or the shards of one model would step apart."""
    flags = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    flags[dist.get_rank()] = float(failed_here)
    comm.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]
