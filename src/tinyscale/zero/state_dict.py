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

The torch optimizer holds one state per parameter fragment (its part of this rank's shard):
tensor states are laid into shard-shaped buffers, all-gathered and cut into parameters;
scalars (Adam's per-parameter `step`, which differs between parameters that were unused in
some steps) are agreed with a max-all-reduce. A parameter never stepped has no state, as in
torch. Padding is never stepped and never saved.
Lesson: lessons/03-zero.md. Tests: tests/zero/test_zero_checkpoint.py.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

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


def _schema(sharded: ShardedOptimizer) -> dict[str, str]:
    """Every state key any rank holds -> "tensor" (shaped like its parameter), "scalar"
    (a 0-d tensor: Adam's step), "number" or "none"; agreed over the group, because a rank
    may hold no stepped fragment at all (its shard all padding or never-used parameters)."""
    local: dict[str, str] = {}
    for state in sharded.optimizer.state.values():
        for key, value in state.items():
            kind = ("tensor" if value.dim() > 0 else "scalar") if torch.is_tensor(value) else \
                "none" if value is None else "number"
            local.setdefault(key, kind + ("" if not torch.is_tensor(value) else f":{str(value.dtype)[6:]}"))
    if not sharded.distributed:
        return local
    every: list = [None] * sharded.world_size
    dist.all_gather_object(every, local, group=sharded.process_group)
    merged: dict[str, str] = {}
    for d in every:
        for key, kind in d.items():
            merged.setdefault(key, kind)
    return merged


@torch.no_grad()
def gather_optimizer_state(sharded: ShardedOptimizer, names: dict[int, str]) -> dict:
    """The full optimizer state by parameter name (`names`: id(param) -> name); every rank.

    The torch optimizer keeps one state per parameter fragment (`ShardedOptimizer`): tensor
    states are laid into a shard-shaped buffer and all-gathered; scalars (step) and whether a
    parameter has any state (it was stepped at least once) ride one small max-all-reduce per
    unit, since the rank that writes may hold no fragment of a parameter."""
    schema = _schema(sharded)
    scalars = [k for k, kind in schema.items() if kind.split(":")[0] in ("scalar", "number")]
    state: dict[str, dict] = {}
    for i, unit in enumerate(sharded.units):
        frags = sharded.fragments[i]
        with _resident(sharded, i, write=False):
            states = [sharded.optimizer.state.get(f.view, {}) for f in frags]
            # column 0: has state; then one column per scalar key (exact in float64: counters)
            table = torch.full((len(unit.params), 1 + len(scalars)), -math.inf, dtype=torch.float64)
            for f, st in zip(frags, states):
                if st:
                    table[f.index, 0] = 1.0
                    for c, key in enumerate(scalars):
                        table[f.index, 1 + c] = float(st[key])
            if sharded.distributed:
                table = table.to(unit.device)
                comm.all_reduce(table, op=dist.ReduceOp.MAX, group=sharded.process_group)
                table = table.cpu()
            per_param: list[dict] = [{} for _ in unit.params]
            for key, kind in schema.items():
                kind, _, dtype = kind.partition(":")
                dtype = getattr(torch, dtype) if dtype else None
                if kind == "tensor":
                    shard = torch.zeros(unit.shard_numel, dtype=dtype, device=unit.device)
                    for f, st in zip(frags, states):
                        if key in st:
                            shard[f.start:f.end] = st[key].to(unit.device)
                    full = torch.empty(unit.padded_numel, dtype=dtype, device=unit.device)
                    if sharded.distributed:
                        comm.all_gather(full, shard, group=sharded.process_group)
                    else:
                        full.copy_(shard)
                    for entry, view in zip(per_param, unit.views(full)):
                        entry[key] = view.to("cpu", copy=True)
                elif kind == "none":
                    for entry in per_param:
                        entry[key] = None
                else:
                    column = table[:, 1 + scalars.index(key)]
                    for entry, value in zip(per_param, column.tolist()):
                        entry[key] = torch.tensor(value, dtype=dtype) if kind == "scalar" else value
        for p, entry, has in zip(unit.params, per_param, (table[:, 0] > 0).tolist()):
            if has:  # never stepped (no gradient yet, anywhere): no state, as torch keeps none
                state[names[id(p)]] = entry
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": params}
              for g, params in zip(sharded.optimizer.param_groups, _group_names(sharded, names))]
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def load_optimizer_state(sharded: ShardedOptimizer, saved: dict, names: dict[int, str]) -> None:
    """Inverse of `gather_optimizer_state`: cut this rank's fragments of a by-name state."""
    ours, theirs = _group_names(sharded, names), [g["params"] for g in saved["param_groups"]]
    if ours != theirs:
        raise ValueError(
            "load_checkpoint: the checkpoint's optimizer covers different parameters than this "
            f"engine's (saved groups {theirs}, here {ours}); was it written for another model, or "
            "with other parameters frozen or grouped differently?")
    for group, saved_group in zip(sharded.optimizer.param_groups, saved["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    for i, frags in enumerate(sharded.fragments):
        with _resident(sharded, i, write=True):
            for f in frags:
                entry = saved["state"].get(names[id(f.param)])
                old = sharded.optimizer.state.get(f.view, {})
                if not entry:  # not stepped when saved: no state
                    sharded.optimizer.state.pop(f.view, None)
                    continue
                for key, value in entry.items():
                    if torch.is_tensor(value) and value.dim() > 0:  # shaped like its parameter
                        # in the state's own dtype (fp32 under mixed precision), not the unit's fp16/bf16
                        value = value.reshape(-1)[f.param_start: f.param_start + f.end - f.start]
                        if key in old and torch.is_tensor(old[key]) and old[key].shape == value.shape:
                            old[key].copy_(value)  # in place: the disk tier's swap keeps this tensor
                            continue
                        value = value.to(f.view.device, copy=True)
                    elif torch.is_tensor(value):
                        value = value.clone()
                    old[key] = value
                for key in [k for k in old if k not in entry]:
                    del old[key]
                sharded.optimizer.state[f.view] = old
        if sharded.swap is not None:  # states born here go to disk as the step's do
            sharded.register_states(i)


@torch.no_grad()
def load_master_from_params(sharded: ShardedOptimizer, publish=None) -> None:
    """Master shards := this rank's shard of the (just loaded, full) parameters.

    Stage 3 passes `publish(i, shard)` to write its parameter shards too (call it while the
    units are gathered)."""
    sharded.wait_params()  # (overlap_param_gather) a gather in flight reads the masters, writes the parameters
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
    sharded.wait_params()  # (overlap_param_gather) a gather in flight reads the masters
    for i, (unit, master) in enumerate(zip(sharded.units, sharded.master)):
        flat = torch.zeros(unit.padded_numel, dtype=master.dtype, device=unit.device)
        unit.flatten([masters[names[id(p)]].to(unit.device) for p in unit.params], out=flat)
        with _resident(sharded, i, write=True):
            master.copy_(unit.shard(flat))
