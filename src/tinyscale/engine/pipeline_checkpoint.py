"""Checkpoints under pipeline parallelism: the optimizer state of every stage, by original name.

A checkpoint holds the whole model's state under the original model's names, whatever the
layout (`engine/checkpoint.py`), so one written with a pipeline loads without one and the
reverse. The parameters come from `full_state_dict()` (broadcast from each stage's rank);
the optimizer state is this rank's stages' only, so `gather_optimizer_state` collects every
pp rank's by name (the ranks of a dp group hold the same stages: ZeRO's gather has already
made each rank's complete) and `local_optimizer_state` cuts out this rank's share on load.

A tied embedding/head is one parameter of the original model, named ``embed.weight`` in its
`named_parameters()`; under a pipeline the last stage's copy is ``head.weight``, with the same
state (the same summed gradients stepped it): saved once under ``embed.weight``, and loaded
from it into both copies (`aliases`).
Test: `pytest tests/engine/test_engine_pipeline.py -k resume`.
"""

from __future__ import annotations

import torch.distributed as dist

from tinyscale.engine.checkpoint import CheckpointError


def gather_optimizer_state(local: dict, order: dict[str, int], aliases: dict[str, str], group) -> dict:
    """Every pp rank's by-name optimizer state merged (on every rank of `group`), the parameters
    of each group in the original model's order `order` (name -> position)."""
    mine = {"state": {aliases.get(n, n): s for n, s in local["state"].items()},
            "param_groups": [{**g, "params": [aliases.get(n, n) for n in g["params"]]} for g in local["param_groups"]]}
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)  # small dicts of CPU tensors
    state: dict[str, dict] = {}
    for part in parts:
        for name, entry in part["state"].items():
            state.setdefault(name, entry)  # a tied table's two copies hold the same state
    groups = []
    for g, first in enumerate(parts[0]["param_groups"]):
        names = {n for part in parts for n in part["param_groups"][g]["params"]}
        groups.append({**first, "params": sorted(names, key=order.__getitem__)})
    return {"state": state, "param_groups": groups}


def local_optimizer_state(saved: dict, local_names: list[str], aliases: dict[str, str]) -> dict:
    """This rank's share of a whole-model by-name optimizer state, under this rank's names
    (`local_names`: its parameters in order)."""
    groups = []
    for g in saved["param_groups"]:
        theirs = set(g["params"])
        groups.append({**g, "params": [n for n in local_names if aliases.get(n, n) in theirs]})
    missing = [n for n in local_names if not any(n in g["params"] for g in groups)]
    if missing:
        raise CheckpointError(f"load_checkpoint: the checkpoint's optimizer has no parameter groups holding {missing}")
    state = {n: saved["state"][aliases.get(n, n)] for n in local_names if aliases.get(n, n) in saved["state"]}
    return {"state": state, "param_groups": groups}
