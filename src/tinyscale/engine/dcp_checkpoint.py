"""Sharded checkpoints on torch.distributed.checkpoint (DCP), driven by the placements.

    save(engine, directory, extras)     # every rank writes the pieces it owns and counts
    load(engine, directory)             # every rank reads the pieces its layout needs

What the checkpoint holds is the SINGLE-PROCESS model, in the key layout of torch's own DCP
recipe (``dcp.save({"model": model_sd, "optim": optim_sd})`` with the state dicts of
`torch.distributed.checkpoint.state_dict.get_state_dict`, checked against torch 2.13's FSDP2 on
gloo in `pytest -k dcp_interop`), global shapes, no padding:

    model.<fqn>                          each parameter of the original model (a tied table once,
                                         under its first name); mixed precision: the fp32 master,
                                         as FSDP2 keeps its sharded parameters in fp32
    optim.state.<fqn>.<key>              the optimizer's per-parameter state (exp_avg, exp_avg_sq:
                                         shaped like the parameter; step: a 0-d tensor)
    optim.param_groups.<i>.<hyper>       each group's hyperparameters, and ``.params``: its fqns
    tinyscale.rank.<r>                   rank r's random generators (and TP's tracker stream,
                                         and compression's residuals): written by rank r
    tinyscale.loss_scaler                fp16's scaler state

Which rank writes what follows from `engine.plan.placements` alone. A parameter's elements
that a rank holds are flat ranges of its TP shard (the whole shard; under ZeRO the fragments
of its flat shard, `Placement.zero_ranges`). A flat range of an N-d tensor is not a box, so
`boxes` cuts it into at most 2N - 1 boxes (a partial row, whole rows, a partial row); each box
moves to global coordinates by the shard's offset along its TP dim (`Placement.tp_range`; an
expert shard's by its first expert along dim 0, `Placement.ep_range`), and becomes one DCP
chunk (`WriteItem` with `ChunkStorageMetadata` offsets and sizes). A rank writes a piece only
if it counts it: `tp_counted` and `pp_counted` (a replicated tensor on TP rank 0, a replicated
K/V head on its first copy, a tied table on the first stage), and over dp x cp either its ZeRO
fragment or, unsharded, on reduce rank 0 (an expert shard: on the first rank of its
expert-data-parallel group). Vocab padding rows (they end a TP shard) and ZeRO padding (past the last parameter) are never in a range, so never written;
DCP's global plan validation then checks that the chunks of every tensor cover it without
overlap (it drops identical chunks from two ranks silently, so `-k dcp_checkpoint` counts what
each rank's file holds against the elements that rank counts).
Scalars (Adam's step) and hyperparameters are written by the rank holding element 0.

Loading asks DCP only for the boxes this rank's layout needs (all of its TP shard, or under
ZeRO-3 only its fragments), whatever layout wrote them: DCP's read planning intersects them
with the saved chunks (`create_read_items_for_chunk_list`) and copies each overlap in place
into the parameter, master or state tensor that needs it. A rank holds, beyond its own
shards, one saved chunk at a time while it reads (DCP's reader loads a chunk, then narrows
it) and one piece at a time while it writes (DCP's writer clones a view whose storage is
bigger); `pytest -k dcp_checkpoint_memory` measures that.

The directory is a version of `engine/checkpoint_io.py`'s (``latest`` pointer, atomic
commit): DCP's files (``__<rank>_0.distcp``, ``.metadata``) plus meta.json, whose SHA-256
table lists every file; every rank verifies a share of the files before anything is read, and
a problem found by any rank is raised on every rank, naming the file and the rank that found it.
Every rank writes into the same directory: on several machines it must be a shared file system
(as for DCP's own FileSystemWriter).

Async save (`Engine.save_checkpoint(..., blocking=False)`): `snapshot` copies this rank's pieces
to host memory (its own shards: pinned when there is a GPU), then a background thread writes them
and commits over a gloo group of its own; `latest` moves only once every rank's write succeeded.

Interop (`pytest -k dcp_interop`): a checkpoint written by torch's FSDP2 + DCP with torch's
recipe loads (a plain DCP directory: no meta.json, so no checksums, step 0, no random state), and
torch's `dcp.load` + `set_state_dict` reads tinyscale's. A tied table is one key here; torch's
state_dict names it twice (embed.weight, head.weight), so a tied model's torch checkpoint is
refused by `check_compatible` with the extra name. `export` / `import_file` convert to and from
one torch.save file in one process (the whole model in memory, as in the file).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import io
import math
import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from tinyscale.engine.checkpoint_io import CheckpointError
from tinyscale.engine.plan import Placement, placements

MODEL, STATE, GROUPS, RANK, SCALER = "model.", "optim.state.", "optim.param_groups.", "tinyscale.rank.", \
    "tinyscale.loss_scaler"


# --8<-- [start:boxes]
def boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The flat range [start, end) of a row-major tensor of `shape` as boxes (offsets, sizes),
    in flat order; each box is contiguous in the flat tensor. At most 2 len(shape) - 1 of them."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    out = []
    if start % inner:  # a partial first row
        row, stop = start // inner, min(end, (start // inner + 1) * inner)
        out += [((row, *o), (1, *s)) for o, s in boxes(shape[1:], start - row * inner, stop - row * inner)]
        start = stop
    rows = (end - start) // inner
    if rows and start < end:  # whole rows
        out.append(((start // inner, *[0] * (len(shape) - 1)), (rows, *shape[1:])))
        start += rows * inner
    if start < end:  # a partial last row
        out += [((start // inner, *o), (1, *s)) for o, s in boxes(shape[1:], 0, end - start)]
    return out
# --8<-- [end:boxes]


@dataclasses.dataclass
class Piece:
    """A box of a checkpoint tensor and the tensor here that is (saving) or receives (loading) it."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_shape: tuple[int, ...]
    tensor: torch.Tensor  # shaped `sizes`: a view into a parameter, master or state


def real_shape(pl: Placement) -> tuple[int, ...]:
    """The TP shard without its vocab padding rows (which end it: the real elements lead)."""
    if pl.tp == "shard" and pl.tp_range is not None:
        shape = list(pl.local_shape)
        shape[pl.tp_dim] = pl.tp_range[1] - pl.tp_range[0]
        if pl.tp_dim != 0 and shape != list(pl.local_shape):
            raise ValueError(f"{pl.name}: padding along dim {pl.tp_dim} of a TP shard is not at its end")
        return tuple(shape)
    return tuple(pl.local_shape)


def pieces(pl: Placement, key: str, start: int, end: int, flat: torch.Tensor) -> list[Piece]:
    """The boxes of the flat range [start, end) of `pl`'s TP shard, padding cut off, each with
    its view of `flat` (a 1-d tensor holding exactly that range); a shard's box is cut again
    where its rows stop being consecutive in the original tensor (`Placement.tp_runs`)."""
    shape = real_shape(pl)
    split = pl.tp in ("shard", "kv_copy")
    runs = pl.tp_runs or (((0, shape[pl.tp_dim], pl.tp_range[0]),) if split else ())
    out = []
    for offsets, sizes in boxes(shape, start, min(end, math.prod(shape))):
        first = sum(o * math.prod(shape[d + 1:]) for d, o in enumerate(offsets)) - start
        view = flat[first:first + math.prod(sizes)].view(sizes)
        if not split:
            if pl.ep_range is not None:  # an expert shard: its experts' place along dim 0
                offsets = (offsets[0] + pl.ep_range[0], *offsets[1:])
            out.append(Piece(key, tuple(offsets), tuple(sizes), pl.global_shape, view))
            continue
        d, lo = pl.tp_dim, offsets[pl.tp_dim]
        for a, b, g in runs:
            s0, s1 = max(lo, a), min(lo + sizes[d], b)
            if s0 < s1:
                o, n = list(offsets), list(sizes)
                o[d], n[d] = g + s0 - a, s1 - s0
                out.append(Piece(key, tuple(o), tuple(n), pl.global_shape, view.narrow(d, s0 - lo, s1 - s0)))
    return out


def holds_first_element(pl: Placement, start: int) -> bool:
    return start == 0 and (pl.tp not in ("shard", "kv_copy") or pl.tp_range[0] == 0) and \
        (pl.ep_range is None or pl.ep_range[0] == 0)


# ---------------------------------------------------------------------------------------------
# What this rank holds, parameter by parameter.

@dataclasses.dataclass
class Held:
    """One flat range [start, end) of a parameter's TP shard held here: the values (`flat`:
    the parameter, or its fp32 master), the optimizer's state for it and where that lives."""

    placement: Placement
    param: torch.Tensor
    start: int
    end: int
    flat: torch.Tensor
    target: torch.Tensor | None  # the optimizer's key for this range (param, master, fragment view)
    group: int | None           # its parameter group's index (None: frozen)


def held(engine) -> list[Held]:
    """Every range of every parameter this rank holds (tied copies and replicas included)."""
    table = placements(engine, include_frozen=True)
    aliases = engine.pipeline.aliases if engine.pipeline is not None else {}
    out = []
    seen = set()
    zero = engine.zero
    for name, param in engine.model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        pl = table[aliases.get(name, name)]
        numel = math.prod(pl.local_shape)
        if not param.requires_grad:
            out.append(Held(pl, param, 0, numel, param.data.view(-1), None, None))
        elif zero is None:
            target, group = _plain_target(engine, param)
            out.append(Held(pl, param, 0, numel, target.data.view(-1), target, group))
    if zero is not None:
        sharded = zero.sharded
        groups = [g for g in sharded.param_groups if g["params"]]
        group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
        names = {id(p): aliases.get(n, n) for n, p in engine.model.named_parameters()}
        for frags in sharded.fragments:
            for f in frags:
                pl = table[names[id(f.param)]]
                out.append(Held(pl, f.param, f.param_start, f.param_start + f.end - f.start, f.view, f.view,
                                group_of[id(f.param)]))
    return out


def _plain_target(engine, param) -> tuple[torch.Tensor, int]:
    """Without ZeRO: the tensor the optimizer steps for `param` (its fp32 master under mixed precision)."""
    opt = torch_optimizer(engine)
    target = param
    mp = getattr(engine.optimizer, "masters", None)
    if mp is not None:
        target = dict(zip(map(id, engine.optimizer.params), mp))[id(param)]
    for i, g in enumerate(opt.param_groups):
        if any(t is target for t in g["params"]):
            return target, i
    raise ValueError("a trainable parameter in no optimizer group")


def torch_optimizer(engine) -> torch.optim.Optimizer:
    return engine._torch_optimizer()


def _writes(engine, h: Held) -> bool:
    """Whether this rank writes range `h`: counted over tp and pp, and once over dp x cp."""
    pl = h.placement
    first = engine.reduce_rank == 0 if pl.reduce_over == "dp" else engine.dp_rank < engine.plan.ep  # edp rank 0
    return pl.tp_counted and pl.pp_counted and (pl.zero_sharded or first)


def _group_table(engine, items: list[Held]) -> list[dict]:
    """The global parameter groups: hyperparameters and the fqns of every stage, in the model's
    order (a small all-gather of names under a pipeline or ZeRO, where a rank holds a part)."""
    opt = torch_optimizer(engine)
    local: dict[int, dict] = {}
    for h in items:
        if h.group is not None:
            entry = local.setdefault(h.group, {"hyper": {k: v for k, v in opt.param_groups[h.group].items()
                                                        if k != "params"}, "params": set()})
            entry["params"].add(h.placement.name)
    for i, g in enumerate(opt.param_groups):  # a group empty here still exists
        local.setdefault(i, {"hyper": {k: v for k, v in g.items() if k != "params"}, "params": set()})
    parts = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
    order = engine.pipeline.order if engine.pipeline is not None else \
        {n: i for i, n in enumerate(n for n, _ in engine.model.named_parameters())}
    groups = []
    for i in range(max(len(p) for p in parts)):
        names = set().union(*(p[i]["params"] for p in parts if i in p))
        hyper = next(p[i]["hyper"] for p in parts if i in p)
        groups.append({**hyper, "params": sorted(names, key=order.__getitem__)})
    return groups


@contextmanager
def _dcp(what: str, directory: Path):
    """Around a DCP call: no warning that it runs in one process when there is no process group
    (intended here), and its `CheckpointException` (a BaseException carrying every failed rank's
    error, raised on every rank) turned into this rank's own error, or a `CheckpointError`
    naming each failed rank and its error (which names the file)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    except CheckpointException as exc:
        mine = exc.failures.get(dist.get_rank() if dist.is_initialized() else 0)
        if mine is not None and what == "save":
            raise mine[0] from None
        detail = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(exc.failures.items()))
        raise CheckpointError(f"{what}_checkpoint: {directory}: {detail}") from None


# ---------------------------------------------------------------------------------------------
# Save

class _SavePlanner(DefaultSavePlanner):
    """DCP's default global planning (metadata, validation that chunks tile each tensor) over
    this rank's pieces; the local plan and the data come from them, not from a state_dict."""

    def __init__(self, tensors: list[Piece], objects: dict[str, object]):
        super().__init__()
        self.tensors = {(p.key, p.offsets): p for p in tensors}
        self.objects = objects

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.state_dict, self.is_coordinator, self.mappings = {}, is_coordinator, {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for p in self.tensors.values():
            props = TensorProperties(dtype=p.tensor.dtype)
            chunk = ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=torch.Size(p.sizes))
            items.append(WriteItem(index=MetadataIndex(p.key, p.offsets), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=chunk, properties=props,
                                                               size=torch.Size(p.global_shape))))
        items += [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in self.objects]
        # the nested form for torch's own readers (dcp_to_torch_save): "model.a.b" -> ("model", "a.b")
        mappings = {it.index.fqn: _path(it.index.fqn) for it in items}
        self.plan = SavePlan(items, planner_data=mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self.objects[write_item.index.fqn], buf)
            return buf
        return self.tensors[(write_item.index.fqn, tuple(write_item.index.offset))].tensor.detach()


def _path(key: str) -> tuple:
    for prefix in (STATE, GROUPS):
        if key.startswith(prefix):
            head, rest = tuple(prefix[:-1].split(".")), key[len(prefix):]
            if prefix == GROUPS:
                i, _, k = rest.partition(".")
                return (*head, int(i), k)
            name, _, k = rest.rpartition(".")
            return (*head, name, k)
    first, _, rest = key.partition(".")
    return (first, rest)


def save_items(engine) -> tuple[list[Piece], dict[str, object]]:
    """The pieces (tensors) and objects this rank writes."""
    items = held(engine)
    opt = torch_optimizer(engine)
    tensors: list[Piece] = []
    objects: dict[str, object] = {}
    for h in items:
        if not _writes(engine, h):
            continue
        name = h.placement.name
        tensors += pieces(h.placement, MODEL + name, h.start, h.end, h.flat.detach())
        state = opt.state.get(h.target, {}) if h.target is not None else {}
        first = holds_first_element(h.placement, h.start)
        for k, v in state.items():
            key = f"{STATE}{name}.{k}"
            if torch.is_tensor(v) and v.dim() > 0 and v.numel() == h.target.numel():  # shaped like it
                tensors += pieces(h.placement, key, h.start, h.end, v.detach().view(-1))
            elif first and torch.is_tensor(v):  # a scalar (step), or another shape (factored): whole, once
                shape = tuple(v.shape)
                tensors.append(Piece(key, (0,) * len(shape), shape, shape, v.detach()))
            elif first:
                objects[key] = v
    groups = _group_table(engine, items)
    if not dist.is_initialized() or dist.get_rank() == 0:
        for i, g in enumerate(groups):
            for k, v in g.items():
                objects[f"{GROUPS}{i}.{k}"] = v
        if engine.loss_scaler is not None:
            objects[SCALER] = engine.loss_scaler.state_dict()
    return tensors, objects


def _resident(engine, write: bool) -> ExitStack:
    """ZeRO's disk tier (offload nvme): this rank's master and state shards in memory inside."""
    stack = ExitStack()
    sharded = engine.zero.sharded if engine.zero is not None else None
    if sharded is not None and sharded.swap is not None:
        for i in range(len(sharded.units)):
            stack.enter_context(sharded.swap.resident(sharded._swap_keys(i), write=write))
    return stack


def save(engine, directory: Path, rank_state: dict) -> list[str]:
    """Write this rank's pieces into `directory` (every rank, the same directory); returns the
    files this rank wrote (for their checksums)."""
    with _resident(engine, write=False):
        tensors, objects = save_items(engine)
        objects[f"{RANK}{dist.get_rank() if dist.is_initialized() else 0}"] = rank_state
        return write(directory, tensors, objects)


# --8<-- [start:snapshot]
def snapshot(engine, rank_state: dict) -> tuple[list[Piece], dict[str, object]]:
    """This rank's pieces copied to host memory (pinned when there is a GPU) and its objects
    copied: what an async save writes in the background while training changes the originals."""
    pin = torch.cuda.is_available()
    with _resident(engine, write=False):
        tensors, objects = save_items(engine)
        tensors = [dataclasses.replace(p, tensor=torch.empty(p.tensor.shape, dtype=p.tensor.dtype, pin_memory=pin)
                                       .copy_(p.tensor)) for p in tensors]
    objects = copy.deepcopy(objects)
    objects[f"{RANK}{dist.get_rank() if dist.is_initialized() else 0}"] = copy.deepcopy(rank_state)
    return tensors, objects
# --8<-- [end:snapshot]


def write(directory: Path, tensors: list[Piece], objects: dict[str, object], group=None) -> list[str]:
    """DCP's save of these pieces and objects (over process group `group`, default: the world);
    returns the files this rank wrote."""
    writer = dcp.FileSystemWriter(directory, single_file_per_rank=True, sync_files=True, thread_count=1)
    with _dcp("save", directory):
        dcp.save({}, storage_writer=writer, planner=_SavePlanner(tensors, objects), process_group=group)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    return sorted(p.name for p in directory.glob(f"__{rank}_*.distcp"))


# ---------------------------------------------------------------------------------------------
# Load

class _LoadPlanner(LoadPlanner):
    """Reads exactly the boxes in `tensors` (and the objects named) from whatever chunks were saved."""

    def __init__(self, tensors: list[Piece], objects: list[str]):
        self.tensors, self.object_keys, self.objects = tensors, objects, {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        md, items = self.metadata.state_dict_metadata, []
        for i, p in enumerate(self.tensors):
            chunk = ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=torch.Size(p.sizes))
            for it in create_read_items_for_chunk_list(p.key, md[p.key], [chunk]):
                items.append(dataclasses.replace(it, dest_index=MetadataIndex(p.key, p.offsets, index=i)))
        for k in self.object_keys:
            zero = torch.Size((0,))
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(k), dest_offsets=zero,
                                  storage_index=MetadataIndex(k), storage_offsets=zero, lengths=zero))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        value.seek(0)
        self.objects[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        t = self.tensors[read_item.dest_index.index].tensor
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(d, o, n)
        return t

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out views: the data is in place


def read_metadata(directory: Path):
    return dcp.FileSystemReader(directory).read_metadata()


def saved_shapes(metadata) -> dict[str, tuple[int, ...]]:
    """The model's parameters in a checkpoint: fqn -> global shape."""
    return {k[len(MODEL):]: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
            if k.startswith(MODEL) and isinstance(v, TensorStorageMetadata)}


def read_objects(directory: Path, keys: list[str]) -> dict[str, object]:
    """Small non-tensor entries (every rank that calls it reads them; a collective)."""
    planner = _LoadPlanner([], keys)
    with _dcp("load", directory):
        dcp.load({}, storage_reader=dcp.FileSystemReader(directory), planner=planner)
    return planner.objects


@torch.no_grad()
def load(engine, directory: Path, metadata) -> None:
    """Fill this rank's parameters, masters and optimizer states from the checkpoint at `directory`."""
    with _resident(engine, write=True):
        _load(engine, directory, metadata)
    sharded = engine.zero.sharded if engine.zero is not None else None
    if sharded is not None and sharded.swap is not None:
        for i in range(len(sharded.units)):  # states born here go to disk as the step's do
            sharded.register_states(i)


def _load(engine, directory: Path, metadata) -> None:
    md = metadata.state_dict_metadata
    opt = torch_optimizer(engine)
    stage3 = engine.zero is not None and hasattr(engine.zero, "publish_shard")
    tensors: list[Piece] = []
    new_states: list[tuple[torch.Tensor, dict]] = []
    scalars: dict[str, list[torch.Tensor]] = {}
    objects: set[str] = set()
    items = held(engine)
    if engine.zero is not None and not stage3:  # stage 1/2: every parameter whole, beside its master shards
        whole = {id(h.param): h for h in items}
        table, aliases = placements(engine), engine.pipeline.aliases if engine.pipeline is not None else {}
        names = {id(p): aliases.get(n, n) for n, p in engine.model.named_parameters()}
        for p in engine.zero.sharded.params:
            if id(p) not in whole:  # no fragment here
                whole[id(p)] = Held(table[names[id(p)]], p, 0, 0, p.data.view(-1), None, None)
        for h in whole.values():
            if h.param.requires_grad:
                tensors += pieces(h.placement, MODEL + h.placement.name, 0, math.prod(h.placement.local_shape),
                                  h.param.data.view(-1))
    for h in items:
        pl, name = h.placement, h.placement.name
        tensors += pieces(pl, MODEL + name, h.start, h.end, h.flat)  # the values (fp32 masters)
        if h.target is None:
            continue
        state, old = {}, opt.state.get(h.target, {})
        for key in (k for k in md if k.startswith(f"{STATE}{name}.") and "." not in k[len(STATE) + len(name) + 1:]):
            k = key[len(STATE) + len(name) + 1:]
            entry = md[key]
            if isinstance(entry, BytesStorageMetadata):
                objects.add(key)
                state[k] = key
            elif tuple(entry.size) != tuple(pl.global_shape):  # a scalar, or another shape: whole
                state[k] = torch.zeros(tuple(entry.size), dtype=entry.properties.dtype, device=h.flat.device)
                scalars.setdefault(key, []).append(state[k])
            else:  # shaped like the parameter, master or fragment; in place where it exists (the disk tier keeps it)
                now = old.get(k)
                same = torch.is_tensor(now) and now.shape == h.target.shape and now.dtype == h.target.dtype
                state[k] = now if same else torch.zeros_like(h.target)
                tensors += pieces(pl, key, h.start, h.end, state[k].view(-1))
        new_states.append((h.target, state))
    for key, targets in scalars.items():  # one read each; copied into every range's state below
        shape = tuple(targets[0].shape)
        tensors.append(Piece(key, (0,) * len(shape), shape, shape, targets[0]))
    planner = _LoadPlanner(tensors, sorted(objects))
    with _dcp("load", directory):
        dcp.load({}, storage_reader=dcp.FileSystemReader(directory), planner=planner)
    for targets in scalars.values():
        for t in targets[1:]:
            t.copy_(targets[0])
    opt.state.clear()
    for target, state in new_states:
        if state:
            opt.state[target] = {k: planner.objects[v] if isinstance(v, str) else v for k, v in state.items()}
    mp = getattr(engine.optimizer, "masters", None)
    if engine.zero is None and mp is not None:  # the parameters: the masters rounded
        for p, m in zip(engine.optimizer.params, mp):
            p.data.copy_(m)
    if stage3:
        for i, (unit, master) in enumerate(zip(engine.zero.sharded.units, engine.zero.sharded.master)):
            engine.zero.publish_shard(i, master.to(unit.dtype))


@torch.no_grad()
def full_state_dict(engine) -> dict[str, torch.Tensor]:
    """The single-process model's state_dict on CPU, on every rank, from the placements: each
    rank contributes the pieces it would write to a checkpoint (as the parameters hold them:
    fp16/bf16 under mixed precision), every rank places them by their global offsets."""
    aliases = engine.pipeline.aliases if engine.pipeline is not None else {}
    names = {id(p): aliases.get(n, n) for n, p in engine.model.named_parameters()}
    mine, shapes = [], {}
    with _resident(engine, write=False):
        for h in held(engine):
            shapes[h.placement.name] = (h.placement.global_shape, h.param.dtype)
            if _writes(engine, h):
                mine += [(p.key, p.offsets, p.tensor.to("cpu", h.param.dtype, copy=True))
                         for p in pieces(h.placement, h.placement.name, h.start, h.end, h.flat.detach())]
    keys, buffers = {}, {}
    for k, v in engine.model.state_dict(keep_vars=True).items():
        if id(v) in names:
            keys[k] = names[id(v)]
        else:
            buffers[k] = v.detach().to("cpu", copy=True)
    parts = [(mine, shapes, keys, buffers)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (mine, shapes, keys, buffers))
    full = {}
    for _, part_shapes, _, _ in parts:
        for name, (shape, dtype) in part_shapes.items():
            full.setdefault(name, torch.zeros(shape, dtype=dtype))
    for part, _, _, _ in parts:
        for name, offsets, tensor in part:
            full[name][tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))] = tensor
    keys = {k: v for _, _, part_keys, _ in parts for k, v in part_keys.items()}
    buffers = {k: v for _, _, _, part_buffers in parts for k, v in part_buffers.items()}
    order = list(engine.pipeline.shapes) if engine.pipeline is not None else list(engine.model.state_dict())
    return {k: full[keys[k]] if k in keys else buffers[k] for k in order}


def read_whole(directory: Path) -> tuple[dict, dict, dict]:
    """Everything in a checkpoint version as whole tensors, in this process alone (no collective):
    (model state by fqn, optimizer state {"state": {fqn: {key: value}}, "param_groups": [...]},
    the tinyscale entries). The export path: it holds the whole model, as the file it writes does."""
    md = read_metadata(directory).state_dict_metadata
    tensors, objects = [], []
    for key, entry in md.items():
        if isinstance(entry, BytesStorageMetadata):
            objects.append(key)
        else:
            shape = tuple(entry.size)
            tensors.append(Piece(key, (0,) * len(shape), shape, shape, torch.empty(shape, dtype=entry.properties.dtype)))
    planner = _LoadPlanner(tensors, objects)
    with _dcp("load", directory):
        dcp.load({}, storage_reader=dcp.FileSystemReader(directory), planner=planner, no_dist=True)
    values = {p.key: p.tensor for p in tensors} | planner.objects
    model = {k[len(MODEL):]: v for k, v in values.items() if k.startswith(MODEL)}
    state: dict[str, dict] = {}
    groups: dict[int, dict] = {}
    extra = {}
    for key, v in values.items():
        path = _path(key)
        if key.startswith(STATE):
            state.setdefault(path[2], {})[path[3]] = v
        elif key.startswith(GROUPS):
            groups.setdefault(path[2], {})[path[3]] = v
        elif not key.startswith(MODEL):
            extra[key] = v
    return model, {"state": state, "param_groups": [groups[i] for i in sorted(groups)]}, extra


# --8<-- [start:export]
def export(path, out) -> dict:
    """`tinyscale checkpoint export DIR OUT.pt`: the checkpoint at `path` (any layout wrote it)
    as one torch.save file, in one process: {"model": state_dict, "optim": {"state", "param_groups"},
    "tinyscale": {"meta", "rng", "loss_scaler"}}; ``torch.load(OUT)["model"]`` loads into the
    plain model. What DeepSpeed's zero_to_fp32 and torch's dcp_to_torch_save do; it holds the
    whole model, as the file does. Returns the meta."""
    from tinyscale.engine import checkpoint  # noqa: PLC0415 - checkpoint imports this module's users

    model, optimizer, meta = checkpoint.read(path)
    extra = {"meta": {k: v for k, v in meta.items() if k not in ("sha256", "rng")}, "rng": meta.get("rng")}
    if "loss_scaler" in optimizer:
        extra["loss_scaler"] = optimizer.pop("loss_scaler")
    torch.save({"model": model, "optim": optimizer, "tinyscale": extra}, out)
    return extra["meta"]


def import_file(source, path) -> Path:
    """`tinyscale checkpoint import IN.pt DIR`: a torch.save file, `export`'s form or a plain
    model state_dict ({fqn: tensor}), as a new version of the checkpoint at `path` (one process).
    A plain state_dict has no optimizer state: the engine that loads it starts its optimizer."""
    from tinyscale.engine import checkpoint_io  # noqa: PLC0415

    saved = torch.load(source, map_location="cpu", weights_only=False)
    if not (isinstance(saved, dict) and "model" in saved and isinstance(saved["model"], dict)):
        saved = {"model": saved}
    extra = saved.get("tinyscale", {})
    tensors = [Piece(MODEL + k, (0,) * v.dim(), tuple(v.shape), tuple(v.shape), v.detach())
               for k, v in saved["model"].items() if torch.is_tensor(v)]
    objects: dict[str, object] = {}
    optim = saved.get("optim") or {"state": {}, "param_groups": []}
    for name, entry in optim["state"].items():
        for k, v in entry.items():
            if torch.is_tensor(v):
                tensors.append(Piece(f"{STATE}{name}.{k}", (0,) * v.dim(), tuple(v.shape), tuple(v.shape), v))
            else:
                objects[f"{STATE}{name}.{k}"] = v
    for i, group in enumerate(optim["param_groups"]):
        objects.update({f"{GROUPS}{i}.{k}": v for k, v in group.items()})
    if extra.get("loss_scaler") is not None:
        objects[SCALER] = extra["loss_scaler"]
    for r, state in ((extra.get("rng") or {}).get("ranks") or {}).items():
        objects[f"{RANK}{r}"] = state
    meta = {"step": 0, "skipped_steps": 0, "world_size": 1, **extra.get("meta", {})}
    meta.pop("format_version", None)
    tmp, name = checkpoint_io.begin(path)
    writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1)
    with _dcp("save", tmp):
        dcp.save({}, storage_writer=writer, planner=_SavePlanner(tensors, objects), no_dist=True)
    checkpoint_io._reach("files_written")
    files = [p.name for p in tmp.iterdir()]
    return checkpoint_io.commit(path, tmp, name, meta, file_digests(tmp, files))
# --8<-- [end:export]


def file_digests(directory: Path, files: list[str]) -> dict[str, str]:
    out = {}
    for f in files:
        h = hashlib.sha256()
        with open(directory / f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        out[f] = h.hexdigest()
    return out


def check_files(directory: Path, digests: dict[str, str], rank: int, world: int) -> str | None:
    """Verify this rank's share of the files (every world-th); the first problem, or None."""
    for i, (f, digest) in enumerate(sorted(digests.items())):
        if i % world != rank:
            continue
        if not (directory / f).is_file():
            return (f"{directory / f} is missing (meta.json lists it; found by rank {rank}): the checkpoint is "
                    "incomplete; restore the file or load an earlier checkpoint")
        actual = file_digests(directory, [f])[f]
        if actual != digest:
            return (f"{directory / f} is corrupt (SHA-256 {actual[:12]}..., expected {digest[:12]}...; found by "
                    f"rank {rank}): restore it or load an earlier checkpoint")
    return None


__all__ = ["CheckpointError", "Piece", "boxes", "load", "pieces", "read_metadata", "read_objects", "save",
           "save_items", "saved_shapes"]
