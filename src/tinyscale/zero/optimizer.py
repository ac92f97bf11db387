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

The optimizer is any `torch.optim` optimizer: it sees one tensor per unit and parameter
group, so per-group hyperparameters (no weight decay on norms) work unchanged. Padding
elements have zero gradient and zero initial value, and stay zero under SGD and AdamW.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from tinyscale.dist import comm
from tinyscale.zero.flat import FlatUnit, split_into_units
from tinyscale.zero.offload import OFFLOAD_DEVICES, DiskSwapper, host_device

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
                 param_dtype: torch.dtype | None = None, loss_scaler=None):
        """`unit_key(p)` (stage 3) cuts each group by module instead of by size: parameters
        with the same key share a unit, units ordered by key. `offload` ("none", "cpu",
        "nvme"; `offload.py`): where master shards and optimizer states live and the step runs.
        `param_dtype` (mixed precision: fp16/bf16): the masters keep the parameters' current
        (fp32) values, then the parameters are rounded to it and gradients flow in it;
        `loss_scaler` (fp16; `tinyscale.precision`): overflow is agreed over the group in
        `full_step`, which then skips on every rank together."""
        if offload not in OFFLOAD_DEVICES:
            raise ValueError(f"offload_optimizer.device={offload!r}: choose one of {OFFLOAD_DEVICES}")
        self.offload = offload
        self.process_group = process_group
        # One process without a process group is a group of one: shards are the whole buffer.
        self.distributed = dist.is_initialized()
        self.world_size = dist.get_world_size(process_group) if self.distributed else 1
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.param_groups = normalize_param_groups(params_or_groups)
        self.units: list[FlatUnit] = []
        unit_group: list[int] = []
        for g, group in enumerate(self.param_groups):
            if group["params"]:
                if unit_key is None:
                    new = split_into_units(group["params"], unit_bytes, self.world_size, self.rank,
                                           reverse=reverse_units)
                else:
                    by_key: dict[int, list[torch.Tensor]] = {}
                    for p in group["params"]:
                        by_key.setdefault(unit_key(p), []).append(p)
                    new = [u for key in sorted(by_key)
                           for u in split_into_units(by_key[key], None, self.world_size, self.rank)]
                self.units += new
                unit_group += [g] * len(new)
        # This rank's master copy of its shards (a copy: the full parameters keep their own
        # storage), in host memory when offloaded: the optimizer then creates its states there.
        where = host_device() if offload != "none" else None
        self.master = [unit.shard(unit.flatten([p.detach() for p in unit.params])).to(where, copy=True)
                       for unit in self.units]
        self.loss_scaler = loss_scaler
        if param_dtype is not None:  # masters above hold the full-precision values; round the model's
            with torch.no_grad():
                for unit in self.units:
                    for p in unit.params:
                        p.data = p.data.to(param_dtype)
                    unit.dtype = param_dtype  # flat buffers, gathers and gradient shards in this dtype
        self.swap = DiskSwapper(nvme_path) if offload == "nvme" else None
        for i, m in enumerate(self.master) if self.swap else ():
            self.swap.add(f"{i}/master", m)
        # Gradient shards exist only between the first reduce-scatter of a step and its end.
        self.grad: list[torch.Tensor | None] = [None] * len(self.master)
        opt_groups = [{**{k: v for k, v in group.items() if k != "params"},
                       "params": [m for m, ug in zip(self.master, unit_group) if ug == g]}
                      for g, group in enumerate(self.param_groups)]
        self.optimizer = make_optimizer([og for og in opt_groups if og["params"]])

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
    def full_step(self, max_norm: float = 0.0, publish: Callable[[int, torch.Tensor], None] | None = None) -> bool:
        """Overflow check (fp16), unscale, clip, step, publish; True if the step was skipped.

        Under mixed precision the gradient shards arrive in fp16/bf16 and become fp32 here,
        the masters' dtype, before anything else looks at them."""
        scaler = self.loss_scaler
        if scaler is not None and scaler.found_overflow(self.grad, self.process_group):
            scaler.update(True)  # every rank got the same answer: all skip and back off together
            self.grad = [None] * len(self.master)
            return True
        self.grad = [None if g is None else g.to(m.dtype) for g, m in zip(self.grad, self.master)]
        if scaler is not None:
            scaler.unscale_(self.grad)
        if max_norm > 0:
            self.clip_grad_norm_(max_norm)
        self.step(publish)
        if scaler is not None:
            scaler.update(False)
        return False
    # --8<-- [end:full-step]

    @torch.no_grad()
    def step(self, publish: Callable[[int, torch.Tensor], None] | None = None) -> None:
        """Optimizer step on the shards, then all-gather the updated parameters.

        Stage 3 passes `publish(i, master_shard)`, which writes unit i's updated shard into
        its sharded parameter storage: nothing is gathered, because the next forward gathers
        each unit when it needs it."""
        if self.swap is None:
            for m, g in zip(self.master, self.grad):
                # None for a unit that got no gradient at all: the optimizer skips it.
                # Offloaded: the gradient shard goes down to the host (a no-op on a CPU run).
                m.grad = None if g is None else g.to(m.device)
            self.optimizer.step()
            for i in range(len(self.units)):
                self._publish(i, publish)
        else:
            self._step_from_disk(publish)
        for m in self.master:
            m.grad = None
        self.grad = [None] * len(self.master)

    # --8<-- [start:disk-step]
    def _step_from_disk(self, publish: Callable[[int, torch.Tensor], None] | None) -> None:
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
            for j, other in enumerate(self.master):
                other.grad = None if j != i or self.grad[j] is None else self.grad[j].to(m.device)
            self.optimizer.step()
            for name, t in self.optimizer.state.get(m, {}).items():  # states are born in the first step
                if t.shape == m.shape and f"{i}/{name}" not in self.swap:
                    self.swap.add(f"{i}/{name}", t)  # written to its file and freed
            self._publish(i, publish)
            self.swap.swap_out(self._swap_keys(i))
    # --8<-- [end:disk-step]

    def _swap_keys(self, i: int) -> list[str]:
        m = self.master[i]
        return [f"{i}/master"] + [f"{i}/{name}" for name, t in self.optimizer.state.get(m, {}).items()
                                  if f"{i}/{name}" in self.swap]

    def _publish(self, i: int, publish: Callable[[int, torch.Tensor], None] | None) -> None:
        """Updated master shard -> the parameters: stage 3's shard, or all-gathered (1 and 2)."""
        unit, m = self.units[i], self.master[i]
        if publish is not None:
            publish(i, m)
            return
        full = unit.empty_flat()
        if self.distributed:
            comm.all_gather(full, m.to(unit.device, unit.dtype), group=self.process_group)
        else:
            full.copy_(m)
        unit.copy_into_params(full)

    def reduce_scatter_into(self, unit_index: int, grads: Sequence[torch.Tensor | None], async_op: bool = False):
        """Sum `grads` (shaped like the unit's params) over ranks; add this rank's averaged
        shard into its gradient buffer. Returns a handle whose wait() completes the add."""
        unit = self.units[unit_index]
        flat = unit.flatten(grads)
        if self.grad[unit_index] is None:
            self.grad[unit_index] = torch.zeros(unit.shard_numel, dtype=unit.dtype, device=unit.device)
        if not self.distributed:
            return _PendingShard(None, flat, flat, self.grad[unit_index], 1)
        out = torch.empty(unit.shard_numel, dtype=unit.dtype, device=unit.device)
        work = comm.reduce_scatter(out, flat, group=self.process_group, async_op=async_op)
        return _PendingShard(work, flat, out, self.grad[unit_index], self.world_size)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_tensors(self) -> list[torch.Tensor]:
        return [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


class _PendingShard:
    """A reduce-scatter in flight; wait() adds the averaged result into the gradient shard."""

    def __init__(self, work, flat: torch.Tensor, out: torch.Tensor, target: torch.Tensor, world_size: int):
        # `flat` is held until the collective is done: its memory must outlive the send.
        self.work, self.flat, self.out, self.target, self.world_size = work, flat, out, target, world_size

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.target.add_(self.out, alpha=1.0 / self.world_size)
        self.flat = None
