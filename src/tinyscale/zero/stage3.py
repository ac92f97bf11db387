"""ZeRO stage 3: parameters sharded too; each unit is all-gathered just before it runs.

    zero = ZeroStage3(model.parameters(), make_optimizer, group, module=model)   # or wrap=[...]
    for micro in micro_batches: (model(*micro) / n).backward()   # hooks gather, free, reduce-scatter
    zero.step()     # step my shards; no all-gather: the next forward gathers what it needs

Rajbhandari et al., "ZeRO" (2020), sec. 5.3 (P_os+g+p) and 7.2.2 (its 1.5x communication).
Lesson: lessons/03-zero.md. Run the tests: `pytest -k zero3`.

**Units.** One per wrapped module, plus a root unit (the whole model) for every other
trainable parameter. Default `wrap`: every element of every nn.ModuleList (GPT: each block;
the root unit holds the embedding, final norm and head). TinyMLP has no ModuleList, so by
default it is one root unit; `wrap` takes module names (["shared"]) or a predicate
`wrap(name, module) -> bool`. A parameter belongs to the innermost wrapped module holding
it; one held by modules of two units (a tied weight) goes to the root unit. As in FSDP, a
wrapped module's parameters may be used only inside its own forward (TinyMLP's fc_in.weight
is also used by the root's forward, so fc_in cannot be wrapped: that fails with a shape
error). A unit is one `FlatUnit` per parameter group, so group hyperparameters still apply.

**Life of a unit.** A rank keeps its shard (`shards`, B Psi/N); the full flat buffer
exists only while the unit is in use:

    forward pre-hook   all-gather the unit (or wait for its prefetch); issue the all-gather
                       of the unit that ran next in the previous forward (prefetch)
    forward hook       free it; put a grad hook on its outputs
    output grad hook   backward has reached the unit: all-gather it again, prefetch the unit
                       backward reaches next (reverse order of the forward hooks)
    post-accumulate    every parameter has its gradient (all uses summed, tied included):
                       reduce-scatter into the owning shards, drop full gradients, free

Freeing resizes the flat buffer's *storage* to 0 bytes: autograd may hold views of it saved
for backward (linear saves weight.t()), and a new buffer would leave those alive. The
backward all-gather refills the same storage, so those views see the values again. Each
parameter's `.data` also becomes an empty tensor, so `memory_report` counts nothing for it
and a use outside its unit's forward fails loudly instead of reading freed memory.

**Checkpointing.** Recomputation (torch.utils.checkpoint, non-reentrant) runs a module's
forward again inside backward: a unit already gathered for its backward stays gathered,
and a unit recomputed before its backward (a region spanning units) is gathered again.

**Persistent parameters** (DeepSpeed's `stage3_param_persistence_threshold`): a trainable
parameter with fewer elements than `persistence_threshold` stays whole on every rank, in no
unit: never gathered for forward or backward. As in DeepSpeed, its optimizer state is still
sharded (its own FlatUnit per group), its gradient is reduce-scattered at the end of each
backward, and after the step its updated shards are all-gathered into it (one all-gather per
step instead of two per micro-batch). Cost: B Psi_persistent (1 - 1/N) more parameter bytes.
Tests: `pytest -k deepspeed_config_persistence`.

**Frozen parameters** (requires_grad=False) stay full and replicated, outside every unit:
no gradient, no optimizer state, so sharding them would save only B Psi_frozen / N (FSDP
shards them too; a large frozen base, as in LoRA, would want that).

Memory per rank (Psi trainable, N ranks, B bytes per element, K optimizer + master bytes):
parameters B Psi/N + gradients B Psi/N + K Psi/N = (2B + K) Psi / N, Psi padded per
FlatUnit; plus frozen parameters; plus, while running, the root unit (used at both ends of
the forward), the unit in use and the prefetched units: one by default, or as many as
DeepSpeed's stage3_prefetch_bucket_size and stage3_max_live_parameters allow (`stage3_prefetch.py`).

**Order.** Reduce-scatters go in one order on every rank (reverse of the order forwards
started, then units no forward ran), so a parameter unused on some ranks only cannot
reorder them; its unit then waits for backward's end. A wrapped module must run on every
rank or on none (its all-gather is a collective, as in FSDP). A rank whose forward or
backward raised replays the rest of the last complete micro-batch's collectives
(`complete_abandoned`) so that the others finish the step; before any micro-batch has
completed that sequence is unknown, and only a failure on every rank alike is recoverable.

Communication per micro-batch: all-gather in forward (Psi) + all-gather in backward (Psi)
+ reduce-scatter of gradients (Psi) = 3 Psi, each (N-1)/N Psi bus bytes per rank: 1.5x
DDP's all-reduce (2 Psi). A module called twice in one forward is gathered twice.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from tinyscale.dist import comm
from tinyscale.zero.offload import ParamShards
from tinyscale.zero.optimizer import OptimizerFactory, ShardedOptimizer
from tinyscale.zero.stage3_prefetch import units_to_prefetch

Wrap = Callable[[str, nn.Module], bool] | Sequence[str] | None


def wrapped_module_names(model: nn.Module, wrap: Wrap = None) -> list[str]:
    """Names of the modules that become units, in `model.named_modules()` order."""
    modules = dict(model.named_modules())
    if wrap is None:  # every element of every ModuleList
        listed = {id(child) for m in modules.values() if isinstance(m, nn.ModuleList) for child in m}
        return [n for n, m in modules.items() if n and id(m) in listed]
    if callable(wrap):
        return [n for n, m in modules.items() if n and wrap(n, m)]
    unknown = [n for n in wrap if not n or n not in modules]
    if unknown:
        raise ValueError(f"wrap: {type(model).__name__} has no submodule named {unknown}; names come from "
                         f"model.named_modules(), e.g. {list(modules)[1:5]}")
    return [n for n in modules if n in set(wrap)]


def assign_units(model: nn.Module, names: Sequence[str]) -> dict[int, int]:
    """id(param) -> unit: the innermost wrapped module holding it; len(names) is the root unit."""
    root, index = len(names), {n: i for i, n in enumerate(names)}

    def unit_of(module_name: str) -> int:
        parts = module_name.split(".") if module_name else []
        for k in range(len(parts), 0, -1):  # innermost wrapped prefix first
            if ".".join(parts[:k]) in index:
                return index[".".join(parts[:k])]
        return root

    owner: dict[int, int] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):  # tied modules: every name
        u = unit_of(module_name)
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                owner[id(p)] = u if owner.get(id(p), u) == u else root  # held by two units: root
    return owner


@dataclass
class _Unit:
    """One wrapped module's parameters (its FlatUnits) and where they are in their life."""

    module: nn.Module
    flats: list[int]  # indices into sharded.units (one per parameter group and dtype)
    params: list[torch.Tensor]  # trainable; their gradients are reduce-scattered together
    active: int = 0  # forward calls of the module now running
    pending: list | None = None  # all-gather works in flight
    sources: list = field(default_factory=list)  # what they gather from, alive until they land
    full: bool = False  # parameters point at the gathered buffer
    backward: bool = False  # gathered for this backward (recomputation must not free it)
    reduced: bool = False  # gradients sent in this backward
    ready: set[int] = field(default_factory=set)  # params whose gradient arrived


class ZeroStage3:
    """Sharded parameters, gradients and optimizer; gathered per unit by module hooks."""

    # DeepSpeed's stage3_prefetch_bucket_size and stage3_max_live_parameters, in elements (the
    # engine sets them; `stage3_prefetch.py`). None: one unit ahead, no limit.
    prefetch_bucket_size: int | None = None
    max_live_parameters: int | None = None

    def __init__(self, params_or_groups, make_optimizer: OptimizerFactory, process_group=None, *,
                 module: nn.Module, wrap: Wrap = None, prefetch: bool = True,
                 offload_optimizer: str = "none", optimizer_nvme_path: str | None = None,
                 offload_param: str = "none", param_nvme_path: str | None = None,
                 param_dtype: torch.dtype | None = None, loss_scaler=None, persistence_threshold: int = 0,
                 sub_group_size: int | None = None, pin_memory: bool = False, pin_param_memory: bool = False):
        names = wrapped_module_names(module, wrap)
        owner = assign_units(module, names)
        persistent_key = len(names) + 1  # after the root: these FlatUnits come last
        for p in module.parameters():
            if id(p) in owner and p.numel() < persistence_threshold:
                owner[id(p)] = persistent_key
        self.sharded = ShardedOptimizer(params_or_groups, make_optimizer, process_group,
                                        unit_key=lambda p: owner[id(p)], offload=offload_optimizer,
                                        nvme_path=optimizer_nvme_path, param_dtype=param_dtype,
                                        loss_scaler=loss_scaler, sub_group_size=sub_group_size,
                                        pin_memory=pin_memory)
        managed = {id(p) for fu in self.sharded.units for p in fu.params}
        if managed != set(owner):
            missing = [n for n, p in module.named_parameters() if id(p) in set(owner) - managed]
            raise ValueError(f"ZeroStage3: params_or_groups must hold every trainable parameter of the module "
                             f"(stage 3 owns their storage); missing: {missing}")
        self.prefetch, self.process_group = prefetch, process_group
        # This rank's parameter shards (on the device, host or disk: offload.ParamShards), and
        # the full buffers whose storage exists only while gathered.
        # Persistent FlatUnits keep no parameter shard here: their parameters stay whole.
        self.persistent = [i for i, fu in enumerate(self.sharded.units) if owner[id(fu.params[0])] == persistent_key]
        self.shards = ParamShards([torch.empty(0, dtype=fu.dtype, device=fu.device) if i in self.persistent
                                   else fu.shard(fu.flatten([p.detach() for p in fu.params]))
                                   for i, fu in enumerate(self.sharded.units)],
                                  self.sharded.units[0].device, offload_param, param_nvme_path, pin_param_memory)
        self.full = [fu.empty_flat() for fu in self.sharded.units]
        self._empty = [torch.empty(0, dtype=fu.dtype, device=fu.device) for fu in self.sharded.units]
        modules = [module.get_submodule(n) for n in names] + [module]
        self.units = [_Unit(m, [], []) for m in modules]
        for i, fu in enumerate(self.sharded.units):
            if i in self.persistent:
                for p in fu.params:
                    p.register_post_accumulate_grad_hook(self._on_persistent_grad)
                continue
            unit = self.units[owner[id(fu.params[0])]]
            unit.flats.append(i)
            unit.params += fu.params
        self.root = len(names)
        self.events: list[tuple[str, int | None, float]] = []
        self.peak_gathered = 0  # most elements of gathered units at once (reset it to measure)
        self._order = [u for u, unit in enumerate(self.units) if unit.params or u == self.root]
        self._order.insert(0, self._order.pop())  # first forward's guess: root, then registration order
        self._prefetch_order: list[int] = []
        self._post_order: list[int] = []
        self._backward_order: list[int] = []
        self._reduce_order: list[int] = []  # this backward's reduce-scatters, the same on every rank
        self._next_reduce = 0
        self._pending_grads: list = []
        self._in_backward = False
        # The collectives of this micro-batch so far, and of the last complete one: a rank whose
        # forward or backward raised replays the rest so that the other ranks never wait.
        self._log: list[tuple[str, int]] = []
        self._last_log: list[tuple[str, int]] | None = None
        for u in self._order:
            self.units[u].module.register_forward_pre_hook(partial(self._before_forward, u))
            self.units[u].module.register_forward_hook(partial(self._after_forward, u))
            for j, p in enumerate(self.units[u].params):
                p.register_post_accumulate_grad_hook(partial(self._on_grad, u, j))
            self._free(u)

    # --8<-- [start:gather]
    def _issue(self, u: int, kind: str) -> None:
        """Start all-gathering unit u into its full buffers (async: prefetch is this, early)."""
        unit = self.units[u]
        if unit.full or unit.pending is not None or not unit.flats:
            return
        unit.pending = []
        for i in unit.flats:
            full = self.full[i]
            full.untyped_storage().resize_(full.numel() * full.element_size())  # allocate
            source = self.shards.source(i)  # disk tier: read now unless read ahead
            if self.sharded.distributed:
                group = self.sharded.units[i].process_group  # dp x cp; an expert shard's: its edp group
                unit.pending.append(comm.all_gather(full, source, group=group, async_op=True))
                unit.sources.append(source)
            else:
                full.copy_(source)
        self.peak_gathered = max(self.peak_gathered, self.gathered_numel())
        self._log.append(("gather", u))
        self._event(kind, u)

    def _materialize(self, u: int) -> None:
        """Unit u's parameters become views of its gathered buffers (waits for the all-gather)."""
        unit = self.units[u]
        if unit.full or not unit.flats:
            return
        self._issue(u, "gather")
        for work in unit.pending:
            work.wait()
        for i in unit.flats:
            self.shards.release(i)
        unit.pending, unit.sources, unit.full = None, [], True
        for i in unit.flats:
            for p, view in zip(self.sharded.units[i].params, self.sharded.units[i].views(self.full[i])):
                p.data = view

    def _free(self, u: int) -> None:
        unit = self.units[u]
        for work in unit.pending or []:  # a prefetch nobody used: let it land before freeing
            work.wait()
        if unit.pending is not None:
            for i in unit.flats:
                self.shards.release(i)
        unit.pending, unit.sources = None, []
        if unit.full or any(self.full[i].untyped_storage().nbytes() for i in unit.flats):
            for i in unit.flats:
                for p in self.sharded.units[i].params:
                    p.data = self._empty[i]
                self.full[i].untyped_storage().resize_(0)  # views saved by autograd keep no memory
            unit.full = False
            self._event("free", u)
    # --8<-- [end:gather]

    # --8<-- [start:hooks]
    def _before_forward(self, u: int, module, args) -> None:
        if u == self.root and not self._in_backward:  # a new forward begins
            self.events, self._log = [], []
            self._prefetch_order, self._order, self._post_order = self._order, [], []
        unit = self.units[u]
        if unit.backward:  # recomputation (checkpointing) inside this unit's backward: gathered
            return
        self._event("forward", u)
        self._materialize(u)
        unit.active += 1
        if not self._in_backward:
            if u not in self._order:
                self._order.append(u)
            self._prefetch_next(u, self._prefetch_order)

    def _after_forward(self, u: int, module, args, output) -> None:
        unit = self.units[u]
        if unit.backward:
            return
        unit.active -= 1
        if unit.active == 0:
            self._free(u)
        if self._in_backward:  # recomputed outputs: backward uses the graph of the first forward
            return
        self._post_order.append(u)
        if u == self.root:  # forward done: drop any prefetch the forward did not use
            for v in range(len(self.units)):
                self._free(v)
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs:
            register_multi_grad_hook(outputs, partial(self._before_backward, u), mode="any")

    def _before_backward(self, u: int, grad) -> None:
        """The first gradient of one of unit u's outputs: u's backward is next; gather it."""
        self._start_backward()
        unit = self.units[u]
        if not unit.backward:
            self._event("backward", u)
            self._materialize(u)
            unit.backward = True
            self._prefetch_next(u, self._backward_order)

    @torch.no_grad()
    def _on_grad(self, u: int, j: int, param: torch.Tensor) -> None:
        self._start_backward()
        self.sharded.mark_used(param)
        unit = self.units[u]
        unit.ready.add(j)
        # All uses of every parameter are summed: reduce it, and any ready units behind it.
        # Reduce-scatters go in one order on every rank (reverse forward start, then units no
        # forward ran): a parameter unused on one rank only must not reorder that rank's.
        while self._next_reduce < len(self._reduce_order):
            v = self.units[self._reduce_order[self._next_reduce]]
            if len(v.ready) < len(v.params):
                break
            self._reduce(self._reduce_order[self._next_reduce])
            self._next_reduce += 1
    # --8<-- [end:hooks]

    def _on_persistent_grad(self, param: torch.Tensor) -> None:
        self._start_backward()  # reduced with the others when backward ends
        self.sharded.mark_used(param)

    def _prefetch_next(self, u: int, order: list[int]) -> None:
        if self.prefetch and u in order:
            later = [v for v in order[order.index(u) + 1:] if not (self.units[v].reduced or self.units[v].backward)]
            if self.prefetch_bucket_size is not None:  # units already gathered are not candidates
                later = [v for v in later if not self.units[v].full and self.units[v].pending is None]
            numel = [sum(self.full[i].numel() for i in self.units[v].flats) for v in later]
            n = units_to_prefetch(numel, self.gathered_numel(), self.prefetch_bucket_size, self.max_live_parameters)
            for v in later[:n]:
                self._issue(v, "prefetch")
            for i in self.units[later[n]].flats if len(later) > n else ():
                self.shards.read_ahead(i)  # disk tier: the unit after those starts reading now

    def _start_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            reverse = list(reversed(self._post_order))
            self._backward_order = sorted(set(reverse), key=reverse.index)
            # A unit's gradients are complete when backward reaches its first use: the reverse
            # of the order forwards started in (the root, started first, completes last).
            started = list(reversed(self._order))
            self._reduce_order = started + [u for u, unit in enumerate(self.units) if unit.params and u not in started]
            self._next_reduce = 0
            Variable._execution_engine.queue_callback(self._on_backward_end)

    # --8<-- [start:reduce]
    @torch.no_grad()
    def _reduce(self, u: int) -> None:
        """Reduce-scatter unit u's gradients into the owning shards (async), then free it all."""
        unit = self.units[u]
        for i in unit.flats:
            params = self.sharded.units[i].params
            self._pending_grads.append(self.sharded.reduce_scatter_into(i, [p.grad for p in params], async_op=True))
            for p in params:
                p.grad = None  # the flat copy is on the wire
        unit.reduced, unit.backward = True, False
        if unit.flats:
            self._log.append(("reduce", u))
        self._event("reduce_scatter", u)
        self._free(u)

    @torch.no_grad()
    def _on_backward_end(self) -> None:
        self._event("backward_end", None)
        for u in self._reduce_order[self._next_reduce:]:  # a gradient that never came counts as zero
            self._reduce(u)
        for i in self.persistent:  # whole parameters: their gradients are complete only now
            params = self.sharded.units[i].params
            self._pending_grads.append(self.sharded.reduce_scatter_into(i, [p.grad for p in params], async_op=True))
            for p in params:
                p.grad = None
        if self.persistent:
            self._log.append(("reduce_persistent", -1))
        self._reset()
        self._last_log, self._log = self._log, []
    # --8<-- [end:reduce]

    def _reset(self) -> None:
        for pending in self._pending_grads:
            pending.wait()
        self._pending_grads.clear()
        for u, unit in enumerate(self.units):
            self._free(u)  # e.g. a prefetch that nobody used
            for p in unit.params:
                p.grad = None  # only a backward that raised leaves one
            unit.ready.clear()
            unit.active, unit.reduced, unit.backward = 0, False, False
        self._in_backward = False

    def abandon_backward(self) -> None:
        """Forget a forward or backward that raised midway (autograd then drops the end
        callback): wait for what is on the wire, free every unit, and drop the full and
        sharded gradients of the step that failed. The engine calls it before every step."""
        self._reset()
        self.sharded.grad = [None] * len(self.sharded.grad)
        self.sharded.forget_usage()
        self._log = []

    @torch.no_grad()
    def complete_abandoned(self, micro_batches_left: int) -> bool:
        """After this rank's forward or backward raised (its step to be dropped), make the
        collectives the other ranks make in the rest of the step: the rest of the last
        complete micro-batch's sequence, then all of it per micro-batch left. False if that
        cannot be known (no micro-batch completed yet, or this one went differently so far)."""
        done, plan = self._log, self._last_log
        self.abandon_backward()  # what is in flight lands; units freed
        if not self.sharded.distributed:
            return True
        if plan is None or done != plan[:len(done)]:
            return False
        for kind, u in plan[len(done):] + plan * (micro_batches_left - 1):
            for i in self.persistent if kind == "reduce_persistent" else self.units[u].flats:
                if kind != "gather":
                    self.sharded.reduce_scatter_into(i, [None] * len(self.sharded.units[i].params)).wait()
                    continue
                full = self.full[i]
                full.untyped_storage().resize_(full.numel() * full.element_size())
                comm.all_gather(full, self.shards.source(i), group=self.sharded.units[i].process_group)
                self.shards.release(i)
                full.untyped_storage().resize_(0)
        self.abandon_backward()  # drop the gradient shards the replay made
        return True

    def _event(self, kind: str, u: int | None) -> None:
        self.events.append((kind, u, time.perf_counter()))

    def gathered_numel(self) -> int:
        """Elements of the full buffers allocated now (gathered or being gathered)."""
        return sum(f.numel() for f in self.full if f.untyped_storage().nbytes())

    def materialized(self) -> list[int]:
        """Units whose full parameters occupy memory now (read from the buffers' storage)."""
        return [u for u, unit in enumerate(self.units) if any(self.full[i].untyped_storage().nbytes()
                                                                for i in unit.flats)]

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit full inside the block (e.g. to read a state_dict); call on every rank."""
        try:
            for u in range(len(self.units)):
                self._materialize(u)
            yield
        finally:
            for u in range(len(self.units)):
                self._free(u)

    def step(self, max_norm: float = 0.0, used: torch.Tensor | None = None) -> bool:
        """Clip and step; returns True if fp16 overflow skipped it (on every rank). `used`:
        see `ZeroStage1.step`."""
        return self.sharded.full_step(max_norm, publish=self.publish_shard, used=used)

    def publish_shard(self, i: int, master_shard: torch.Tensor) -> None:
        """Unit i's updated shard -> my parameter shard; a persistent unit's all-gathered
        into its whole parameters (the step's only all-gather)."""
        if i in self.persistent:
            self.sharded.publish_gathered(i)
        else:
            self.shards.write(i, master_shard)

    def set_lr(self, lr: float) -> None:
        self.sharded.set_lr(lr)
