"""The sharded optimizer step shared by ZeRO stages 1, 2 and 3.

Each rank keeps, for every `FlatUnit`, only its shard of:

    master  the parameters the optimizer updates (fp32 master weights in mixed precision;
            here the same dtype as the model), shape (shard_numel,)
    grad    the averaged gradient of that shard, shape (shard_numel,)
    state   the optimizer's state for that shard (Adam: exp_avg, exp_avg_sq)

Gradient shards are allocated by the step's first reduce-scatter and freed by the step,
so between steps a rank holds no gradient at all.

A step is: clip by the global norm (each rank's shard norms, summed across ranks), step the
torch optimizer on the master shards, then all-gather every unit's updated shards into
the full parameters that forward uses. How the gradient shards get filled is what
distinguishes the stages (`stage1.py`: one reduce-scatter per unit after backward;
`stage2.py`: reduce-scatters launched during backward; `stage3.py`: the same, and its
step copies the shards into sharded parameters instead: it gathers only when a module runs).

The optimizer is any `torch.optim` optimizer: it sees one tensor per parameter fragment
(the part of a parameter inside this rank's shard, a view of the master shard), in its
parameter group, so per-group hyperparameters (no weight decay on norms) work unchanged,
padding is never stepped, and a parameter that got no gradient on any rank is skipped
exactly as torch skips a `None` grad (its state and step count untouched). Where that is
exact (torch's Adam, AdamW or SGD; every parameter of the piece stepped) a unit's consecutive
fragments are stepped as one tensor (pieces of up to 1 MiB), as DeepSpeed steps one flat
partition, their states views of the piece's (`flat_step.py`): the same values, a few calls
instead of one per fragment. Which parameters
got one is agreed once per step: `agree_used` (one all-reduce of a flag per parameter), or
the engine's loss all-reduce carries the flags (`used_here`), which costs no extra collective.
Lesson: lessons/02-data-parallel.md, "Unused parameters". Tests: `pytest -k unused`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from tinyscale.dist import comm
from tinyscale.zero.flat import FlatUnit, split_into_units
from tinyscale.zero.flat_step import FlatStep
from tinyscale.zero.offload import OFFLOAD_DEVICES, DiskSwapper, to_host
from tinyscale.zero.sub_groups import group_fragments, sub_group_starts

COMM_DTYPES = {None: None, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


def normalize_param_groups(params_or_groups) -> list[dict]:
    """torch's forms (an iterable of tensors, or of dicts with "params") -> list of dicts."""
    items = list(params_or_groups)
    if items and isinstance(items[0], dict):
        return [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in items]
    return [{"params": [p for p in items if p.requires_grad]}]


class ShardedOptimizer:
    """Master weights, gradients and optimizer state for this rank's shard of every unit."""

    def __init__(self, params_or_groups, make_optimizer: OptimizerFactory, process_group=None,
                 unit_bytes: int | None = None, reverse_units: bool = False,
                 unit_key: Callable[[torch.Tensor], int] | None = None,
                 offload: str = "none", nvme_path: str | None = None,
                 param_dtype: torch.dtype | None = None, loss_scaler=None, sub_group_size: int | None = None,
                 pin_memory: bool = False, first_unit_bytes: int | None = None):
        """`first_unit_bytes`: the first unit's cap if smaller than `unit_bytes` (stages 1 and 2: a
        small first bucket, torch DDP's layout).
        `unit_key(p)` (stage 3) cuts each group by module instead of by size: parameters
        with the same key share a unit, units ordered by key. `offload` ("none", "cpu",
        "nvme"; `offload.py`): where master shards and optimizer states live and the step runs.
        `param_dtype` (mixed precision: fp16/bf16): the masters keep the parameters' current
        (fp32) values, then the parameters are rounded to it and gradients flow in it;
        `loss_scaler` (fp16; `tinyscale.precision`): overflow is agreed over the group (or
        `overflow_group`, if the caller widens it) in `full_step`, which then skips on every
        rank together. `sub_group_size` (DeepSpeed's; `sub_groups.py`): the step runs on at
        most that many elements at a time; None: all.
        `pin_memory` (offload "cpu", with a GPU): master shards in pinned host memory."""
        if offload not in OFFLOAD_DEVICES:
            raise ValueError(f"offload_optimizer.device={offload!r}: choose one of {OFFLOAD_DEVICES}")
        self.offload = offload
        self.process_group = process_group
        # One process without a process group is a group of one: shards are the whole buffer.
        self.distributed = dist.is_initialized()
        self.world_size = dist.get_world_size(process_group) if self.distributed else 1
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.param_groups = normalize_param_groups(params_or_groups)
        self.first_unit_bytes = first_unit_bytes
        self.units: list[FlatUnit] = []
        unit_group: list[int] = []
        for g, group in enumerate(self.param_groups):
            if group["params"]:
                if unit_key is None:
                    new = self._split(group["params"], unit_bytes, reverse_units)
                else:
                    by_key: dict[int, list[torch.Tensor]] = {}
                    for p in group["params"]:
                        by_key.setdefault(unit_key(p), []).append(p)
                    new = [u for key in sorted(by_key) for u in self._split(by_key[key], None, False)]
                self.units += new
                unit_group += [g] * len(new)
        # This rank's master copy of its shards (a copy: the full parameters keep their own
        # storage), in host memory when offloaded: the optimizer then creates its states there.
        shards = [unit.shard(unit.flatten([p.detach() for p in unit.params])) for unit in self.units]
        self.master = [s.clone() if offload == "none" else to_host(s, pin_memory and offload == "cpu") for s in shards]
        bases = [sum(u.shard_numel for u in self.units[:i]) for i in range(len(self.units))]
        self.fragments: list[list[Fragment]] = [
            fragments_of(unit, m, sub_group_starts(base, unit.shard_numel, sub_group_size))
            for unit, m, base in zip(self.units, self.master, bases)]
        # (unit, fragment) pairs per sub-group; one sub-group (the default): one optimizer step
        self.sub_groups = group_fragments(self.fragments, bases, sub_group_size)
        self.loss_scaler = loss_scaler
        # The ranks that agree on an overflow: this group, unless the caller widens it (the
        # engine: the whole world, whose other axes hold the rest of the model).
        self.overflow_group = process_group
        self.last_grad_norm: float | None = None  # the last clipping norm (none without clipping)
        if param_dtype is not None:  # masters above hold the full-precision values; round the model's
            with torch.no_grad():
                for unit in self.units:
                    for p in unit.params:
                        p.data = p.data.to(param_dtype)
                    unit.dtype = param_dtype  # flat buffers, gathers and gradient shards in this dtype
        self.swap = DiskSwapper(nvme_path) if offload == "nvme" else None
        for i, m in enumerate(self.master) if self.swap else ():
            self.swap.add(f"{i}/master", m)
        self._params_flat: list[torch.Tensor | None] = [None] * len(self.units)  # see params_flat
        # Gradient shards exist only between the first reduce-scatter of a step and its end.
        self.grad: list[torch.Tensor | None] = [None] * len(self.master)
        # The torch optimizer steps one tensor per parameter *fragment*: each parameter's
        # intersection with this rank's shard, a view of the master shard (FSDP2 shards per
        # parameter for the same reason). A parameter that got no gradient on any rank gets
        # grad None, so torch skips exactly it: no decay, no state, no step count, as in one process.
        self.params = [p for unit in self.units for p in unit.params]  # the order of usage flags
        self._index = {id(p): k for k, p in enumerate(self.params)}
        # this rank's usage flags: a Python list, since the gradient hooks set one per gradient
        # (a tensor's item assignment is two ops, select and fill_, about 10 us each call)
        self._used_here = [False] * len(self.params)
        opt_groups = [{**{k: v for k, v in group.items() if k != "params"},
                       "params": [f.view for frags, ug in zip(self.fragments, unit_group) if ug == g for f in frags]}
                      for g, group in enumerate(self.param_groups) if group["params"]]
        self.optimizer = make_optimizer(opt_groups)  # a group may be empty on a rank: torch allows it
        # Stepped as a few flat tensors per unit where that is exact: `flat_step.py`
        # (None: every step per fragment; the disk tier's swapper moves states per fragment).
        position = {g: n for n, g in enumerate(g for g, group in enumerate(self.param_groups) if group["params"])}
        self.flat = None if offload == "nvme" else FlatStep.build(
            self.optimizer, self.fragments, self.sub_groups, self.master, [position[g] for g in unit_group],
            self._index)

    # --8<-- [start:expert-units]
    def _split(self, params: list[torch.Tensor], cap: int | None, reverse: bool) -> list[FlatUnit]:
        """`split_into_units` over this optimizer's group; expert shards (tinyscale.moe.shard_experts,
        DeepSpeed-MoE's separate MoE groups) in units of their own after the others, sharded over
        their expert-data-parallel group. Each unit says the group it is reduced, sharded and
        gathered over (`process_group`) and how many ranks its gradient is averaged over (`mean_over`)."""
        dense = [p for p in params if getattr(p, "expert_shard", None) is None]
        first = self.first_unit_bytes
        units = split_into_units(dense, cap, self.world_size, self.rank, reverse=reverse,
                                 first_cap_bytes=first) if dense else []
        for u in units:
            u.process_group, u.mean_over = self.process_group, self.world_size
        by_group: dict[int, list[torch.Tensor]] = {}
        for p in params:
            if getattr(p, "expert_shard", None) is not None:
                by_group.setdefault(id(p.expert_shard.group), []).append(p)
        for experts in by_group.values():
            shard = experts[0].expert_shard
            size, rank = (dist.get_world_size(shard.group), dist.get_rank(shard.group)) if self.distributed else (1, 0)
            for u in split_into_units(experts, cap, size, rank, reverse=reverse):
                u.process_group, u.mean_over = shard.group, shard.mean_over
                units.append(u)
        return units
    # --8<-- [end:expert-units]

    # --8<-- [start:usage]
    def mark_used(self, param: torch.Tensor) -> None:
        """The stages' gradient hooks call this: `param` got a gradient on this rank this step."""
        self._used_here[self._index[id(param)]] = True

    def used_here(self) -> torch.Tensor:
        """This rank's usage flags (1.0 per parameter that got a gradient this step), float64 so
        that the engine can send them in its loss all-reduce: the sum counts the ranks that used it."""
        return torch.tensor(self._used_here, dtype=torch.float64)

    def agree_used(self) -> torch.Tensor:
        """Which parameters got a gradient on some rank: one small all-reduce (len(params) int32)."""
        flags = torch.tensor(self._used_here, dtype=torch.int32, device=self.units[0].device)
        if self.distributed:
            comm.all_reduce(flags, group=self.process_group)
        return flags.cpu() > 0

    def agree_used_async(self) -> tuple[torch.Tensor, object]:
        """`agree_used`, launched: (counts, handle); after handle.wait(), ``counts.cpu() > 0``."""
        flags = torch.tensor(self._used_here, dtype=torch.int32, device=self.units[0].device)
        return flags, comm.all_reduce(flags, group=self.process_group, async_op=True) if self.distributed else None

    def forget_usage(self) -> None:
        self._used_here = [False] * len(self.params)
    # --8<-- [end:usage]

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale every shard's gradient as torch.nn.utils.clip_grad_norm_ would the full gradient."""
        local = torch.zeros((), dtype=torch.float64, device=self.units[0].device)
        for g in self.grad:
            if g is not None:
                local += g.double().pow(2).sum()
        if self.distributed:
            comm.all_reduce(local, group=self.process_group)  # sum of squares over all shards
        total_norm = local.sqrt()
        # the same arithmetic as torch's clip_grad_norm_, so float64 results match it exactly
        clip_coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
        for g in self.grad:
            if g is not None:
                g.mul_(clip_coef.to(g.dtype))
        return total_norm.item()

    # --8<-- [start:full-step]
    @torch.no_grad()
    def full_step(self, max_norm: float = 0.0, publish: Callable[[int, torch.Tensor], None] | None = None,
                  used: torch.Tensor | None = None) -> bool:
        """Overflow check (fp16), unscale, clip, step, publish; True if the step was skipped.

        `used`: which parameters got a gradient on some rank (bool per `self.params`), if the
        caller has already agreed it (the engine, in its loss all-reduce); else `agree_used`.
        Under mixed precision the gradient shards arrive in fp16/bf16 and become fp32 here,
        the masters' dtype, before anything else looks at them."""
        used = self.agree_used() if used is None else used
        self.forget_usage()
        scaler = self.loss_scaler
        if scaler is not None and scaler.found_overflow(self.grad, self.overflow_group):
            scaler.update(True)  # every rank got the same answer: all skip and back off together
            self.grad = [None] * len(self.master)
            return True
        self.grad = [None if g is None else g.to(m.dtype) for g, m in zip(self.grad, self.master)]
        if scaler is not None:
            scaler.unscale_(self.grad)
        if max_norm > 0:
            self.last_grad_norm = self.clip_grad_norm_(max_norm)  # read by the engine's monitor
        self.step(publish, used)
        if scaler is not None:
            scaler.update(False)
        return False
    # --8<-- [end:full-step]

    @torch.no_grad()
    def step(self, publish: Callable[[int, torch.Tensor], None] | None = None,
             used: torch.Tensor | None = None) -> None:
        """Optimizer step on the shards, then all-gather the updated parameters.

        `used` (bool per parameter, the same on every rank; None: all) says which fragments
        get a gradient; the others are skipped by the torch optimizer. Stage 3 passes
        `publish(i, master_shard)`, which writes unit i's updated shard into its sharded
        parameter storage: nothing is gathered, because the next forward gathers each unit
        when it needs it."""
        self.wait_params()  # (overlap_param_gather) the last step's gathers write the parameters
        used = used.tolist() if torch.is_tensor(used) else used  # read once per fragment: no tensor indexing
        if self.swap is None:
            # --8<-- [start:sub-groups]
            flat = self.flat if self.flat_step else None
            for s, group in enumerate(self.sub_groups):  # sub_group_size: one sub-group's temporaries at a time
                # flat pieces (a few per unit) where exact (`flat_step.py`); the rest per fragment
                rest = group if flat is None else flat.prepare(s, self.grad, used)
                for i in range(len(self.units)) if rest else ():
                    self._attach_grads(i, used, [k for j, k in rest if j == i])
                self.optimizer.step()  # torch skips every fragment whose grad is None; the flat pieces first
                self._detach_grads(rest)
            # --8<-- [end:sub-groups]
            # overlap_param_gather: the last unit (the first layers, which forward reads first) goes first
            for i in reversed(range(len(self.units))) if self.overlap_param_gather else range(len(self.units)):
                self._publish(i, publish, in_flight=True)
            # every unit's gather in flight at once, then one wait (2 gloo ranks, the small GPT's two
            # units, 2026-11-27: 2.5 ms against 4.1 one after the other); overlap_param_gather: left in flight
            if not self.overlap_param_gather:
                self.wait_params()
        else:
            self._step_from_disk(publish, used)
        for frags in self.fragments:
            for f in frags:
                f.view.grad = None
        if self.flat is not None:
            self.flat.detach()
        self.grad = [None] * len(self.master)

    # --8<-- [start:attach]
    def _attach_grads(self, i: int, used: Sequence[bool] | None, which: Sequence[int] | None = None) -> None:
        """Each fragment of unit i (those in `which`, a sub-group's: consecutive) gets its
        slice of the gradient shard, or None if its parameter got no gradient anywhere (or
        the unit none at all)."""
        frags = self.fragments[i] if which is None else [self.fragments[i][k] for k in which]
        g, lo = self.grad[i], frags[0].start if frags else 0
        # Offloaded: the fragments' part of the gradient shard goes down to the host (a no-op on a CPU run).
        g = None if g is None or not frags else g[lo:frags[-1].end].to(self.master[i].device)
        for f in frags:
            stepped = g is not None and (used is None or bool(used[self._index[id(f.param)]]))
            f.view.grad = g[f.start - lo:f.end - lo] if stepped else None
    # --8<-- [end:attach]

    # --8<-- [start:disk-step]
    def _step_from_disk(self, publish: Callable[[int, torch.Tensor], None] | None,
                        used: torch.Tensor | None) -> None:
        """One unit at a time: read the next unit's states while stepping this one, write it
        back behind. Stepping a subset is exact: torch optimizers skip params whose grad is None."""
        keys = [self._swap_keys(i) for i in range(len(self.units))]
        self.swap.prefetch(keys[0])
        for i, m in enumerate(self.master):
            if i >= 2:
                self.swap.wait(self._swap_keys(i - 2))  # bound: unit i-1 writing, i stepping, i+1 reading
            if i + 1 < len(self.master):
                self.swap.prefetch(keys[i + 1])
            self.swap.swap_in(keys[i])
            for group in self.sub_groups:  # unit i's fragments, one sub-group at a time
                mine = [k for j, k in group if j == i]
                if mine:
                    self._attach_grads(i, used, mine)
                    self.optimizer.step()
                    self._detach_grads([(i, k) for k in mine])  # the next step must not step these again
            self.register_states(i)  # states are born in a fragment's first step
            self._publish(i, publish)
            self.swap.swap_out(self._swap_keys(i))
    # --8<-- [end:disk-step]

    def _detach_grads(self, group: Sequence[tuple[int, int]]) -> None:
        for i, k in group:
            self.fragments[i][k].view.grad = None

    def register_states(self, i: int) -> None:
        """Disk tier: unit i's fragment states not yet in the swapper go there (written, freed)."""
        for k, f in enumerate(self.fragments[i]):
            for name, t in self.optimizer.state.get(f.view, {}).items():
                if torch.is_tensor(t) and t.dim() > 0 and f"{i}/{k}/{name}" not in self.swap:
                    self.swap.add(f"{i}/{k}/{name}", t)

    def _swap_keys(self, i: int) -> list[str]:
        return [f"{i}/master"] + [f"{i}/{k}/{name}" for k, f in enumerate(self.fragments[i])
                                  for name in self.optimizer.state.get(f.view, {})
                                  if f"{i}/{k}/{name}" in self.swap]

    def _publish(self, i: int, publish: Callable[[int, torch.Tensor], None] | None, in_flight: bool = False) -> None:
        """Updated master shard -> the parameters: stage 3's shard, or all-gathered (1 and 2;
        `in_flight`: see `publish_gathered`)."""
        if publish is not None:
            publish(i, self.master[i])
        else:
            self.publish_gathered(i, in_flight=in_flight)

    # False: every step per fragment, as before `flat_step.py` (tests compare the two paths)
    flat_step: bool = True

    # True (stages 1-2 set it): the parameters live in one flat buffer per unit, the all-gather's
    # output (`params_flat`); False: a fresh flat buffer per gather, copied into the parameters.
    flat_params: bool = False

    # DeepSpeed's zero_optimization.allgather_bucket_size (elements; stages 1-2, the engine
    # sets it): no all-gather of updated parameters moves more. Each rank's shard is cut into
    # pieces of max(1, size // N) elements, one all-gather per piece: ceil(shard_numel / piece)
    # calls per unit. None: one all-gather per unit.
    allgather_bucket_size: int | None = None

    # --8<-- [start:param-gather]
    # Megatron's overlap_param_gather (stages 1-2 set it): `publish_gathered` launches each unit's
    # gather and returns; `wait_params` completes them. The stage waits in a forward pre-hook of
    # each module before it reads its parameters (`param_gather.py`); any other reader of the
    # parameters before the next forward must call `wait_params()` first. The units go out
    # last first (units are cut in backward's order: the last one holds the first layers).
    # `gather_piece_numel` (None: one all-gather per unit) cuts each unit into pieces of at least
    # that many elements at parameter boundaries, in forward's order, each a contiguous range
    # of the flat buffer gathered by one all-to-all (every rank sends its part of the range to
    # all): the first layers then wait for their piece only. On 2 gloo ranks the whole unit was
    # as fast (more messages, each with its own latency), hence the default.
    overlap_param_gather: bool = False
    gather_piece_numel: int | None = None
    _gathers: dict | None = None  # (unit, piece) -> (work, send buffer) in flight

    def gather_pieces(self, i: int) -> list[tuple[int, int, list[int]]]:
        """Unit i's pieces in forward's order: (lo, hi, indices of its parameters), flat ranges
        from the end of the buffer down (the first covers the padding)."""
        unit, out, hi, members = self.units[i], [], self.units[i].padded_numel, []
        if self.gather_piece_numel is None:
            return [(0, hi, list(range(len(unit.params))))]
        for j in reversed(range(len(unit.params))):
            members.append(j)
            lo = unit.offsets[j]
            if hi - lo >= self.gather_piece_numel or j == 0:
                out.append((0 if j == 0 else lo, hi, members))
                hi, members = lo, []
        return out

    def wait_params(self, where=None) -> None:
        """Complete the parameter gathers in flight: those holding the parameters `where`
        ((unit, index in unit) pairs); None: all. Cheap when none is in flight."""
        gathers = self._gathers
        if not gathers:
            return
        keys = list(gathers) if where is None else {self._piece_of.get(w) for w in where} & gathers.keys()
        for key in sorted(keys):
            gathers.pop(key)[0].wait()

    def _launch_gather(self, i: int, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Unit i's gather into `full`, piece by piece, left in flight."""
        unit, n = self.units[i], self.units[i].shard_numel
        if self._gathers is None:
            self._gathers, self._piece_of = {}, {}
        for k, (lo, hi, members) in enumerate(self.gather_pieces(i)):
            self._piece_of.update({(i, j): (i, k) for j in members})
            if (lo, hi) == (0, unit.padded_numel):  # the whole unit: an all-gather
                work, send = comm.all_gather(full, shard, group=unit.process_group, async_op=True), None
            else:  # rank r holds flat[r n, (r + 1) n): what of [lo, hi) each holds, in rank order
                sizes = [max(0, min(hi, (r + 1) * n) - max(lo, r * n)) for r in range(unit.world_size)]
                a = max(lo, unit.rank * n) - unit.rank * n
                send = shard[a:a + sizes[unit.rank]].repeat(unit.world_size)  # kept alive until the wait
                work = comm.all_to_all(full[lo:hi], send, output_split_sizes=sizes,
                                       input_split_sizes=[sizes[unit.rank]] * unit.world_size,
                                       group=unit.process_group, async_op=True)
            self._gathers[(i, k)] = (work, send)
    # --8<-- [end:param-gather]

    # --8<-- [start:param-flat]
    def params_flat(self, i: int) -> torch.Tensor | None:
        """Unit i's parameters as views of one padded flat buffer (made at the first call), so
        that the all-gather writes the updated parameters in place: no flat copy to fill and
        copy out of. None (the copy path) if a parameter cannot live there (another dtype or
        device, not strided). A parameter whose storage was replaced since (``p.data = ...``) is
        taken back into the buffer with its current value."""
        unit, flat = self.units[i], self._params_flat[i]
        if flat is not None and all(p.data_ptr() == v.data_ptr() for p, v in zip(unit.params, unit.views(flat))):
            return flat
        if any(p.dtype != unit.dtype or p.device != unit.device or p.layout != torch.strided or p.shape != shape
               for p, shape in zip(unit.params, unit.shapes)):
            return None
        flat = unit.empty_flat()
        for p, view in zip(unit.params, unit.views(flat)):
            view.copy_(p.detach())  # (the gather that follows overwrites it: a parameter is never garbage)
            p.data = view
        self._params_flat[i] = flat
        return flat
    # --8<-- [end:param-flat]

    def publish_gathered(self, i: int, in_flight: bool = False) -> None:
        """All-gather unit i's updated master shards into its full parameters (in place, if
        they are views of the unit's flat buffer: `params_flat`). `in_flight`: left in flight
        (where it writes the parameters in place) until `wait_params`."""
        unit, m = self.units[i], self.master[i]
        own = self.params_flat(i) if self.flat_params else None
        full = unit.empty_flat() if own is None else own
        if self.distributed:
            shard, n, size = m.to(unit.device, unit.dtype), unit.shard_numel, unit.world_size
            bucket = self.allgather_bucket_size
            piece = n if bucket is None else max(1, bucket // size)
            if piece >= n and own is not None and (self.overlap_param_gather or in_flight):
                self.wait_params([(i, j) for j in range(len(unit.params))])  # one gather at a time per buffer
                self._launch_gather(i, full, shard)
                return  # the gathers write the parameters in place: nothing to copy
            if piece >= n:
                comm.all_gather(full, shard, group=unit.process_group)
            by_rank = full.view(size, n)  # (N, shard_numel): row r is rank r's shard
            for lo in range(0, n, piece) if piece < n else ():
                hi = min(n, lo + piece)
                out = torch.empty(size * (hi - lo), dtype=unit.dtype, device=unit.device)
                comm.all_gather(out, shard[lo:hi].contiguous(), group=unit.process_group)
                by_rank[:, lo:hi].copy_(out.view(size, hi - lo))  # (N, hi - lo)
        else:
            full.copy_(m)
        if own is None:
            unit.copy_into_params(full)

    # DeepSpeed's zero_optimization.reduce_scatter. False: every unit's gradients are all-reduced
    # whole and each rank keeps its slice: the same sums, twice the bytes on the wire (a ring
    # all-reduce sends 2(N-1)/N of the buffer, a reduce-scatter (N-1)/N). The engine sets it.
    reduce_scatter: bool = True
    # DeepSpeed's communication_data_type: gradients are cast to this dtype for the reduction
    # (fp16/bf16: half the bytes, and each rank's term and every partial sum rounded to it),
    # and the result is added into the gradient shard in the unit's dtype. None: the unit's
    # own dtype. The engine sets it.
    comm_dtype: torch.dtype | None = None
    # DeepSpeed's prescale_gradients and gradient_predivide_factor (the engine sets them): true
    # divides by N before the sum (the default here); false divides by the factor before the sum
    # and by N / factor after it (DeepSpeed's default, factor 1: sum, then divide).
    prescale_gradients: bool = True
    gradient_predivide_factor: float = 1.0

    def reduce_scatter_into(self, unit_index: int, grads: Sequence[torch.Tensor | None] | None,
                            async_op: bool = False, *, flat: torch.Tensor | None = None):
        """Sum `grads` (shaped like the unit's params) over ranks; add this rank's averaged
        shard into its gradient buffer. Returns a handle whose wait() completes the add.
        `flat` instead of `grads`: the unit's gradients already laid out in its padded flat
        layout (stages 1 and 2 keep them there: no flattening copy); it is divided and, without
        reduce_scatter, overwritten in place."""
        unit = self.units[unit_index]
        flat = unit.flatten(grads) if flat is None else flat
        first = self.grad[unit_index] is None  # the step's first reduction of this unit
        if not self.distributed:
            if first:
                self.grad[unit_index] = torch.zeros(unit.shard_numel, dtype=unit.dtype, device=unit.device)
            return _PendingShard(None, flat, flat, self.grad[unit_index])
        # Divide before summing (as torch DDP does): in fp16 the sum of N scaled gradients can
        # overflow where their mean would not. (A power-of-two N divides exactly either way.)
        n = unit.mean_over  # the group's size; an expert unit's: dp (see `_split`)
        pre = n if self.prescale_gradients else self.gradient_predivide_factor
        flat.div_(pre)
        post = n / pre  # what the sum is divided by when it arrives
        if self.comm_dtype is not None:
            flat = flat.to(self.comm_dtype)
        if self.reduce_scatter and first and post == 1 and flat.dtype == unit.dtype:
            # the step's first reduction, needing nothing on arrival, lands in the gradient shard itself
            self.grad[unit_index] = out = torch.empty(unit.shard_numel, dtype=unit.dtype, device=unit.device)
            return _PendingShard(comm.reduce_scatter(out, flat, group=unit.process_group, async_op=async_op),
                                 flat, out, None)
        if first:
            self.grad[unit_index] = torch.zeros(unit.shard_numel, dtype=unit.dtype, device=unit.device)
        if not self.reduce_scatter:  # all-reduce the whole unit, keep this rank's slice of it
            lo, hi = unit.shard_range()
            work = comm.all_reduce(flat, group=unit.process_group, async_op=async_op)
            return _PendingShard(work, flat, flat[lo:hi], self.grad[unit_index], post)
        out = torch.empty(unit.shard_numel, dtype=flat.dtype, device=unit.device)
        work = comm.reduce_scatter(out, flat, group=unit.process_group, async_op=async_op)
        return _PendingShard(work, flat, out, self.grad[unit_index], post)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_tensors(self) -> list[torch.Tensor]:
        return [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


class Fragment(NamedTuple):
    """One parameter's part of this rank's master shard: `view` = master[start:end]."""

    param: torch.Tensor
    index: int  # the parameter's position in its unit
    start: int  # in the shard
    end: int
    param_start: int  # where the fragment begins inside the flattened parameter
    view: torch.Tensor


def fragments_of(unit: FlatUnit, master: torch.Tensor, starts: Sequence[int] = ()) -> list[Fragment]:
    """The non-empty intersections of unit's parameters with this rank's shard, in order,
    each cut again at the shard offsets `starts` (where sub-groups begin: `sub_groups.py`)."""
    lo, hi = unit.shard_range()
    out = []
    for j, (p, offset, shape) in enumerate(zip(unit.params, unit.offsets, unit.shapes)):
        start, end = max(lo, offset) - lo, min(hi, offset + shape.numel()) - lo  # in the shard
        cuts = [start] + [c for c in starts if start < c < end] + [end]
        for a, b in zip(cuts, cuts[1:]) if start < end else ():
            out.append(Fragment(p, j, a, b, a + lo - offset, master[a:b]))
    return out


class _PendingShard:
    """A reduce-scatter (of pre-divided gradients) in flight; wait() adds the result, the
    average, into the gradient shard."""

    def __init__(self, work, flat: torch.Tensor, out: torch.Tensor, target: torch.Tensor | None,
                 post: float = 1.0):
        # `flat` is held until the collective is done: its memory must outlive the send.
        # target None: `out` is the gradient shard itself (the step's first reduction of the unit).
        self.work, self.flat, self.out, self.target, self.post = work, flat, out, target, post

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        # post-scaling (prescale_gradients false) in the shard's dtype, not the wire's
        if self.target is not None:
            self.target.add_(self.out if self.post == 1 else self.out.to(self.target.dtype) / self.post)
        self.flat = None
