"""ZeRO stage 3 whose units the caller gathers and frees: for a schedule of many micro-batches.

    zero = ZeroStage3Manual(groups, make_optimizer, group, modules=[stage_a, stage_b])
    zero.gather(0); out = stage_a(x); zero.release(0)       # the caller decides when
    ...                                                     # forwards and backwards, in any order
    zero.reduce_gradients()                                 # once: every unit's gradients
    zero.step()                                             # step my shards (no all-gather)

`ZeroStage3` (`stage3.py`) gathers a unit from hooks that assume one forward of the whole
model and then its backward, micro-batch after micro-batch. A pipeline schedule runs up to p
micro-batches' forwards before their backwards, and zero-bubble splits a backward in two
passes, so here the caller (the engine's pipeline step) says when a unit is needed: one unit
per module in `modules` (a pipeline stage), sharded over `process_group` exactly as stage 3
shards (same `ShardedOptimizer`, `ParamShards`, flat buffers whose storage is freed), and
gradients accumulate whole in ``.grad`` until `reduce_gradients` reduce-scatters each unit once.
Everything else (`step`, `gathered`, checkpoints, the memory report) is stage 3's. Not here:
prefetch (a unit is gathered when the caller asks, so `overlap_comm` and the stage3 prefetch
bounds do nothing) and persistent parameters. Parameter offload (`offload_param`: the shards on
the host or on disk between gathers) is stage 3's `ParamShards`, as there.

Two policies for the caller (torchtitan's ``reshard_after_forward``): keep a unit gathered
while any of its micro-batches is between forward and backward, or free it after every pass
and gather it again for the next (forward, backward, zero-bubble's W). All-gather bytes per
step and unit: the first gathers once per stretch of work in flight (once per step for every
schedule here), the second once per pass: 2m (3m with W) times the unit's padded bytes.
Tests: `pytest tests/engine/test_engine_pipeline_compose.py -k zero3`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tinyscale.zero.offload import ParamShards
from tinyscale.zero.optimizer import OptimizerFactory, ShardedOptimizer
from tinyscale.zero.stage3 import ZeroStage3, _Unit


class ZeroStage3Manual(ZeroStage3):
    """Stage 3's shards and step; units gathered by `gather` and freed by `release`."""

    def __init__(self, params_or_groups, make_optimizer: OptimizerFactory, process_group=None, *,
                 modules: Sequence[nn.Module], offload_optimizer: str = "none", nvme_path: str | None = None,
                 param_dtype: torch.dtype | None = None, loss_scaler=None, sub_group_size: int | None = None,
                 pin_memory: bool = False, offload_param: str = "none", param_nvme_path: str | None = None,
                 pin_param_memory: bool = False):
        owner = {id(p): u for u, m in enumerate(modules) for p in m.parameters() if p.requires_grad}
        self.sharded = ShardedOptimizer(params_or_groups, make_optimizer, process_group,
                                        unit_key=lambda p: owner[id(p)], offload=offload_optimizer,
                                        nvme_path=nvme_path, param_dtype=param_dtype, loss_scaler=loss_scaler,
                                        sub_group_size=sub_group_size, pin_memory=pin_memory)
        if {id(p) for fu in self.sharded.units for p in fu.params} != set(owner):
            raise ValueError("ZeroStage3Manual: params_or_groups must hold exactly the trainable parameters of "
                             "`modules` (each in one module)")
        self.prefetch, self.process_group, self.persistent = False, process_group, []
        device = self.sharded.units[0].device
        self.shards = ParamShards([fu.shard(fu.flatten([p.detach() for p in fu.params])) for fu in self.sharded.units],
                                  device, offload_param, param_nvme_path, pin_param_memory)
        self.full = [fu.empty_flat() for fu in self.sharded.units]
        self._empty = [torch.empty(0, dtype=fu.dtype, device=fu.device) for fu in self.sharded.units]
        self.units = [_Unit(m, [], []) for m in modules]
        for i, fu in enumerate(self.sharded.units):
            self.units[owner[id(fu.params[0])]].flats.append(i)
            self.units[owner[id(fu.params[0])]].params += fu.params
        self.root = len(self.units)  # no root unit: every parameter is in a named module
        self.events: list = []
        self.peak_gathered = 0
        self._pending_grads: list = []
        self._in_backward = False
        self._log: list = []
        self._last_log = None
        for u in range(len(self.units)):
            self._free(u)

    def gather(self, u: int) -> None:
        """Unit u's full parameters, all-gathered over the group (nothing if already there)."""
        self._materialize(u)

    def release(self, u: int) -> None:
        """Free unit u's full parameters (its gradients stay in .grad)."""
        self._free(u)

    # --8<-- [start:reduce-once]
    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Every unit's accumulated gradients reduce-scattered into this rank's shards, once, in
        unit order (a missing gradient counts as zero); the full gradients are dropped."""
        for unit in self.units:
            for i in unit.flats:
                params = self.sharded.units[i].params
                self._pending_grads.append(self.sharded.reduce_scatter_into(i, [p.grad for p in params],
                                                                            async_op=True))
                for p in params:
                    p.grad = None  # the flat copy is on the wire
        for pending in self._pending_grads:
            pending.wait()
        self._pending_grads.clear()
    # --8<-- [end:reduce-once]

    def complete_abandoned(self, micro_batches_left: int) -> bool:
        """The caller drives every gather, also on a rank whose compute raised: nothing to replay."""
        self.abandon_backward()
        return True
