"""ZeRO-1 the PyTorch way: a torch.optim.Optimizer that keeps optimizer state for 1/N of the parameters.

    model = DDP(model)                                           # gradients averaged by DDP, or
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()                 # step my parameters, broadcast them
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, reduce_grads=True, lr=1e-3)  # no DDP
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, reduce_grads=True, stage=2, lr=1e-3)

Rajbhandari et al., "ZeRO" (2020), sec. 5.1 (P_os); the interface is PyTorch's
`ZeroRedundancyOptimizer(params, optimizer_class, **defaults)`. Lesson: lessons/03-zero.md,
"ZeRO the PyTorch way". Run the tests: `pytest -k zero_optimizer_api`.

**Partition.** Whole parameters, as torch's: within each parameter group, largest first,
each to the rank that owns the fewest elements so far (ties: the lower rank). Rank r
builds `optimizer_class` on its own parameters only, so its states (Adam: 2 Psi_r) are
1/N of the total, up to the granularity of whole parameters. (The engine's stages cut flat
buffers instead, so they balance exactly; they also keep fp32 masters: this path does not.)

**Gradients.** `reduce_grads=False` (default, torch's usage): `step()` expects gradients
already averaged over the group (by DDP). `reduce_grads=True` (ZeRO-1 proper, no DDP):
`step()` first sends each parameter's gradient, divided by N, to its owner (`reduce`: the
other ranks never need the sum), with one all-reduce of usage flags first so that a
parameter no rank used keeps `.grad` None and is not stepped (weight decay leaves it alone,
as torch does). Either way each owner steps, then broadcasts each of its parameters.

**Stage 2** (`stage=2`, with `reduce_grads=True`): the same reduces, issued during backward
as each parameter's gradient is complete (a post-accumulate-grad hook), in one fixed order
on every rank (reverse registration order; a parameter waits for those before it, and
those no backward reached are sent as zeros when backward ends), so that a parameter used
on some ranks only cannot reorder the collectives. After its reduce a gradient is dropped
on every rank but its owner, which sums it over micro-batches apart from `.grad`: the full
gradients of the model never exist at once. Usage counts are all-reduced once, at `step()`.
A gradient that must change after backward, before the reduce (a table tied across pipeline
stages: `exchange_tied_grads` after the schedule) needs the backwards run under
`with opt.no_sync():` (DDP's name): the reduces wait, `.grad` accumulates as in torch, and
`step()` reduces them once, as the engine does under a pipeline. A `.grad` found at `step()`
outside `no_sync` was written after its reduce and would be lost: `step()` raises, naming it.

**State dict.** `state_dict()` is a collective: every rank sends its states (serialized,
through `comm.broadcast`) and every rank returns the whole state in the format of a plain
`optimizer_class` on the same parameters (state by global parameter index, groups listing
those indices). So it loads into a ZeroOptimizer at any world size, or into the plain
optimizer in one process; `load_state_dict` keeps the states of this rank's parameters.
"""

from __future__ import annotations

import contextlib
import io

from functools import partial

import torch
import torch.distributed as dist
from torch.autograd import Variable

from tinyscale.dist import comm


class ZeroOptimizer(torch.optim.Optimizer):
    """Optimizer state sharded over ranks by whole parameters (ZeRO stage 1)."""

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer], *, process_group=None,
                 reduce_grads: bool = False, stage: int = 1, **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"ZeroOptimizer: optimizer_class must be a torch.optim.Optimizer subclass, "
                            f"got {optimizer_class!r} (pass the class, e.g. torch.optim.AdamW, not an instance)")
        if stage not in (1, 2) or (stage == 2 and not reduce_grads):
            raise ValueError(f"ZeroOptimizer: stage={stage!r} is invalid: use stage=1, or stage=2 with "
                             f"reduce_grads=True (stage 2 reduces gradients itself, during backward)")
        self.group, self.stage = process_group, stage
        self.distributed = dist.is_initialized()
        self.world = dist.get_world_size(process_group) if self.distributed else 1
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.reduce_grads = reduce_grads
        self.owner: dict[int, int] = {}  # id(param) -> group rank
        self.load = [0] * self.world  # elements owned per rank
        self.local_groups: list[dict] = []
        self.optimizer_class = optimizer_class
        super().__init__(params, defaults)  # calls add_param_group per group
        self.optim = optimizer_class(self.local_groups, **defaults)
        self.defaults = dict(self.optim.defaults)  # all of optimizer_class's hyperparameters
        for group in self.param_groups:
            for k, v in self.defaults.items():
                group.setdefault(k, v)
        if stage == 2:
            self._init_stage2()

    # --8<-- [start:partition]
    def add_param_group(self, param_group: dict) -> None:
        """Add a group and give each of its parameters an owner (largest first, least loaded)."""
        super().add_param_group(param_group)  # fills missing hyperparameters from self.defaults
        group = self.param_groups[-1]
        for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
            r = min(range(self.world), key=lambda k: (self.load[k], k))
            self.owner[id(p)] = r
            self.load[r] += p.numel()
        local = {**group, "params": [p for p in group["params"] if self.owner[id(p)] == self.rank]}
        self.local_groups.append(local)
        if hasattr(self, "optim"):
            self.optim.add_param_group(local)
    # --8<-- [end:partition]

    def _global_rank(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    # --8<-- [start:step]
    @torch.no_grad()
    def step(self, closure=None):
        """(Reduce gradients to their owners,) step this rank's parameters, broadcast them."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"]]
        if self.stage == 2:
            self._finish_stage2()
        elif self.reduce_grads and self.world > 1:
            self._reduce_to_owners([p for p in params if p.requires_grad])
        for group, local in zip(self.param_groups, self.optim.param_groups):
            local.update({k: v for k, v in group.items() if k != "params"})  # an LR scheduler's changes
        self.optim.step()
        if self.world > 1:
            for p in params:
                if p.requires_grad:
                    comm.broadcast(p.data, src=self._global_rank(self.owner[id(p)]), group=self.group)
        return loss

    def _reduce_to_owners(self, params: list[torch.Tensor]) -> None:
        used = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=params[0].device)
        comm.all_reduce(used, group=self.group)  # how many ranks have a gradient for each
        for p, count in zip(params, used.tolist()):
            if count == 0:
                continue  # no rank used it: .grad stays None everywhere, the optimizer skips it
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            grad = grad / self.world  # divide before the sum, as DDP does (an fp16 sum cannot overflow)
            owner = self.owner[id(p)]
            comm.reduce(grad, dst=self._global_rank(owner), group=self.group)
            p.grad = grad if owner == self.rank else None
    # --8<-- [end:step]

    # --8<-- [start:stage2]
    def _init_stage2(self) -> None:
        self.order = [p for g in reversed(self.param_groups) for p in reversed(g["params"]) if p.requires_grad]
        self.summed = [None] * len(self.order)  # the owner's reduced gradients, over micro-batches
        self.uses = torch.zeros(len(self.order))  # backward passes that gave each a gradient here
        self.ready, self.next, self.in_backward = set(), 0, False
        self.holding = False  # inside no_sync: the hooks reduce nothing
        self.held = False  # no_sync was entered (on every rank alike) since the last step: step() reduces .grad
        for i, p in enumerate(self.order):
            p.register_post_accumulate_grad_hook(partial(self._on_grad, i))

    @contextlib.contextmanager
    def no_sync(self):
        """Stage 2: backwards inside keep their gradients in `.grad` (summed over micro-batches, as
        torch does) for `step()` to reduce, so that they can still change after the schedule (a
        tied table's exchange between pipeline stages). The full gradients then exist until step."""
        if self.stage != 2:
            raise ValueError("ZeroOptimizer.no_sync: stage 1 reduces nothing during backward; "
                             "use it with stage=2")
        holding, self.holding, self.held = self.holding, True, True
        try:
            yield
        finally:
            self.holding = holding

    @torch.no_grad()
    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        if self.holding:
            return
        if not self.in_backward:
            self.in_backward = True
            Variable._execution_engine.queue_callback(self._on_backward_end)
        self.ready.add(i)
        while self.next < len(self.order) and self.next in self.ready:  # the fixed order
            self._reduce_one(self.next)
            self.next += 1

    @torch.no_grad()
    def _on_backward_end(self) -> None:
        while self.next < len(self.order):  # no gradient here this backward: zeros
            self._reduce_one(self.next)
            self.next += 1
        self.ready, self.next, self.in_backward = set(), 0, False

    def _reduce_one(self, i: int) -> None:
        p = self.order[i]
        self.uses[i] += p.grad is not None
        grad = p.grad / self.world if p.grad is not None else torch.zeros_like(p)  # divide before the sum
        owner = self.owner[id(p)]
        if self.world > 1:
            comm.reduce(grad, dst=self._global_rank(owner), group=self.group)
        if owner == self.rank:
            self.summed[i] = grad if self.summed[i] is None else self.summed[i] + grad
        p.grad = None  # reduced: the local gradient is no longer needed anywhere

    def _finish_stage2(self) -> None:
        """Step-time: which parameters any rank used (one all-reduce); give owners their sums."""
        if self.held:  # the gradients kept under no_sync: one more pass of reduces, in the fixed order
            for i in range(len(self.order)):
                self._reduce_one(i)
            self.held = False
        late = [i for i, p in enumerate(self.order) if p.grad is not None]
        uses = torch.cat([self.uses, torch.tensor([float(len(late))])])  # the last: late gradients, agreed
        if self.world > 1:
            comm.all_reduce(uses, group=self.group)
        if uses[-1] > 0:  # every rank raises together
            raise ValueError(
                f"ZeroOptimizer stage 2: {int(uses[-1])} .grad(s) over the group were written after backward "
                "reduced and dropped them (exchange_tied_grads after a pipeline schedule?) and would be lost. "
                "Run the backwards under `with optimizer.no_sync():` so the gradients stay in .grad until "
                "step() reduces them, or use stage=1")
        for i, p in enumerate(self.order):
            p.grad = self.summed[i] if uses[i] > 0 and self.owner[id(p)] == self.rank else None
        self.summed, self.uses = [None] * len(self.order), torch.zeros(len(self.order))
    # --8<-- [end:stage2]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.stage == 2:  # gradients reduced but not stepped are dropped too
            self.summed, self.uses, self.held = [None] * len(self.order), torch.zeros(len(self.order)), False
        super().zero_grad(set_to_none)

    def _index(self) -> dict[int, int]:
        return {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    # --8<-- [start:state-dict]
    def state_dict(self) -> dict:
        """The whole state, as a plain `optimizer_class` would give it (a collective)."""
        index = self._index()
        mine = {index[id(p)]: s for p, s in self.optim.state.items()}
        state = dict(mine)
        for r in range(self.world) if self.world > 1 else ():
            blob = _to_bytes(mine) if r == self.rank else None
            state.update(_broadcast_bytes(blob, self._global_rank(r), self.group))
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
                  for g in self.param_groups]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state from `state_dict()` (any world size) or from a plain optimizer."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"load_state_dict: the state has {len(groups)} parameter groups, this optimizer "
                             f"{len(self.param_groups)}: build it on the same parameter groups")
        index = self._index()
        local_state, local_groups, i = {}, [], 0
        for group, saved, local in zip(self.param_groups, groups, self.optim.param_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"load_state_dict: a parameter group holds {len(saved['params'])} parameters in "
                                 f"the state and {len(group['params'])} here")
            group.update({k: v for k, v in saved.items() if k != "params"})
            ids = []
            for p in local["params"]:
                if index[id(p)] in state_dict["state"]:
                    local_state[i] = state_dict["state"][index[id(p)]]
                ids.append(i)
                i += 1
            local_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
    # --8<-- [end:state-dict]


def _to_bytes(obj) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _broadcast_bytes(blob: torch.Tensor | None, src: int, group) -> dict:
    """Rank `src`'s serialized states to every rank: its length, then its bytes."""
    length = torch.tensor([0 if blob is None else blob.numel()], dtype=torch.int64)
    comm.broadcast(length, src=src, group=group)
    data = blob if blob is not None else torch.empty(int(length.item()), dtype=torch.uint8)
    comm.broadcast(data, src=src, group=group)
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
