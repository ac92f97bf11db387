"""Sharded optimizer state <-> one state per parameter NAME, the layout-free checkpoint form.

    saved = gather_optimizer_state(zero.sharded, names)        # every rank (all-gathers)
    load_optimizer_state(zero.sharded, saved, names)           # every rank (cuts its shards)

The form is `tinyscale.engine.checkpoint`'s: ``{"state": {name: {"exp_avg": tensor shaped
like the parameter, "step": ...}}, "param_groups": [{hyperparameters, "params": [names]}]}``,
the same that a plain torch optimizer saves by name. So a checkpoint written by ZeRO stage 3
on 4 ranks loads into stage 1 on 3 ranks, into DDP, or into one process, and back: the
shards are an implementation detail of the run, not of the file. (DeepSpeed writes one
file per rank and needs a conversion step, "universal checkpointing", to change the data
parallel degree; gathering costs memory on save, which is why it does that.)

Every state tensor shaped like its unit's master shard is all-gathered and cut into the
unit's parameters; other values (Adam's scalar `step`) are the same for every parameter
of a unit and are copied. Padding is dropped on save and re-created (zeros) on load.
Lesson: lessons/03-zero.md. Tests: tests/zero/test_zero_checkpoint.py.
"""

from __future__ import annotations

import contextlib

import torch

from tinyscale.dist import comm
from tinyscale.zero.optimizer import ShardedOptimizer


def _resident(sharded: ShardedOptimizer, i: int, write: bool):
    """Unit i's master and states in memory inside the block (the disk tier swaps them in)."""
    if sharded.swap is None:
        return contextlib.nullcontext()
    return sharded.swap.resident(sharded._swap_keys(i), write=write)


def _group_names(sharded: ShardedOptimizer, names: dict[int, str]) -> list[list[str]]:
    # The torch optimizer has one group per non-empty parameter group, in order.
    return [[names[id(p)] for p in g["params"]] for g in sharded.param_groups if g["params"]]


@torch.no_grad()
def gather_optimizer_state(sharded: ShardedOptimizer, names: dict[int, str]) -> dict:
    """The full optimizer state by parameter name (`names`: id(param) -> name); every rank."""
    state: dict[str, dict] = {}
    for i, (unit, master) in enumerate(zip(sharded.units, sharded.master)):
        with _resident(sharded, i, write=False):
            per_param: list[dict] = [{} for _ in unit.params]
            for key, value in sharded.optimizer.state.get(master, {}).items():
                if torch.is_tensor(value) and value.shape == master.shape:
                    full = torch.empty(unit.padded_numel, dtype=value.dtype, device=unit.device)
                    if sharded.distributed:
                        comm.all_gather(full, value.to(unit.device), group=sharded.process_group)
                    else:
                        full.copy_(value)
                    for entry, view in zip(per_param, unit.views(full)):
                        entry[key] = view.to("cpu", copy=True)
                else:
                    for entry in per_param:
                        entry[key] = value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value
        for p, entry in zip(unit.params, per_param):
            if entry:
                state[names[id(p)]] = entry
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": params}
              for g, params in zip(sharded.optimizer.param_groups, _group_names(sharded, names))]
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def load_optimizer_state(sharded: ShardedOptimizer, saved: dict, names: dict[int, str]) -> None:
    """Inverse of `gather_optimizer_state`: cut this rank's shards of a by-name state."""
    ours, theirs = _group_names(sharded, names), [g["params"] for g in saved["param_groups"]]
    if ours != theirs:
        raise ValueError(
            "load_checkpoint: the checkpoint's optimizer covers different parameters than this "
            f"engine's (saved groups {theirs}, here {ours}); was it written for another model, or "
            "with other parameters frozen or grouped differently?")
    for group, saved_group in zip(sharded.optimizer.param_groups, saved["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    for i, (unit, master) in enumerate(zip(sharded.units, sharded.master)):
        entries = [saved["state"].get(names[id(p)]) for p in unit.params]
        present = [e for e in entries if e]
        if not present:
            continue  # never stepped (e.g. saved before the first step): nothing to load
        new = {}
        for key, sample in present[0].items():
            if torch.is_tensor(sample) and sample.dim() > 0:  # shaped like its parameter
                # in the state's own dtype (fp32 under mixed precision), not the unit's fp16/bf16
                flat = torch.zeros(unit.padded_numel, dtype=sample.dtype, device=unit.device)
                unit.flatten([e[key].to(unit.device) if e else None for e in entries], out=flat)
                new[key] = unit.shard(flat).to(master.device, copy=True)
            else:
                new[key] = sample.clone() if torch.is_tensor(sample) else sample
        old = sharded.optimizer.state.get(master, {})
        with _resident(sharded, i, write=True):
            for key, value in new.items():
                if key in old and torch.is_tensor(value) and old[key].shape == value.shape:
                    old[key].copy_(value)  # in place: the disk tier's swap keeps this tensor
                else:
                    old[key] = value
            sharded.optimizer.state[master] = old
        if sharded.swap is not None:  # states born here go to disk as the step's do
            for key, value in old.items():
                if torch.is_tensor(value) and value.shape == master.shape and f"{i}/{key}" not in sharded.swap:
                    sharded.swap.add(f"{i}/{key}", value)


@torch.no_grad()
def load_master_from_params(sharded: ShardedOptimizer, publish=None) -> None:
    """Master shards := this rank's shard of the (just loaded, full) parameters.

    Stage 3 passes `publish(i, shard)` to write its parameter shards too (call it while the
    units are gathered)."""
    for i, (unit, master) in enumerate(zip(sharded.units, sharded.master)):
        shard = unit.shard(unit.flatten([p.detach() for p in unit.params]))
        with _resident(sharded, i, write=True):
            master.copy_(shard)
        if publish is not None:
            publish(i, shard)


@torch.no_grad()
def gather_masters(sharded: ShardedOptimizer, names: dict[int, str]) -> dict[str, torch.Tensor]:
    """Full master weights by parameter name (mixed precision: the fp32 values the rounded
    fp16/bf16 parameters lost); every rank."""
    out = {}
    for i, (unit, master) in enumerate(zip(sharded.units, sharded.master)):
        with _resident(sharded, i, write=False):
            full = torch.empty(unit.padded_numel, dtype=master.dtype, device=unit.device)
            if sharded.distributed:
                comm.all_gather(full, master.to(unit.device), group=sharded.process_group)
            else:
                full.copy_(master)
        for p, view in zip(unit.params, unit.views(full)):
            out[names[id(p)]] = view.to("cpu", copy=True)
    return out


@torch.no_grad()
def load_masters(sharded: ShardedOptimizer, masters: dict[str, torch.Tensor], names: dict[int, str]) -> None:
    """Master shards := this rank's shard of the saved full-precision masters."""
    for i, (unit, master) in enumerate(zip(sharded.units, sharded.master)):
        flat = torch.zeros(unit.padded_numel, dtype=master.dtype, device=unit.device)
        unit.flatten([masters[names[id(p)]].to(unit.device) for p in unit.params], out=flat)
        with _resident(sharded, i, write=True):
            master.copy_(unit.shard(flat))
