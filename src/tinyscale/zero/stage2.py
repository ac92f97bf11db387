"""ZeRO stage 2: gradients sharded too, reduce-scattered in buckets while backward runs.

    zero = ZeroStage2(model.parameters(), make_optimizer, process_group=group, bucket_bytes=...)
    for micro in micro_batches: (model(*micro) / n).backward()   # hooks reduce-scatter as it goes
    zero.step()     # step my shard, all-gather parameters

What changes from stage 1: parameters are packed into buckets (units of at most
``bucket_bytes``, last layers first). As backward produces each gradient, a hook copies it
into its slot of the bucket's flat buffer (allocated at the bucket's first gradient) and
frees it (``p.grad = None``): the gradients live in the flat buffer, so nothing is flattened
before the send, and a bucket never holds its gradients twice. When every gradient of a
bucket is in, its asynchronous **reduce-scatter** is launched; the averaged shard is added
into this rank's gradient buffer when backward ends. So after backward a rank holds only its 1/N of the gradient
(plus, during backward, the buckets in flight), and the communication overlaps backward.

Memory per rank: parameters B*Psi, gradients B*Psi/N, master + optimizer state K*Psi/N.
Communication per step: Psi (reduce-scatter) per micro-batch + Psi (all-gather): with one
micro-batch 2 Psi, the same as DDP. With gradient accumulation every micro-batch's
gradient is reduce-scattered at once (DeepSpeed does the same): keeping the full gradient
across micro-batches would give back the memory stage 2 exists to save. Under a pipeline
schedule, whose micro-batches' backwards interleave with other stages' work, the engine runs
them under `no_sync()` and calls `reduce_gradients()` once at the end, as torchtitan's FSDP
with a pipeline does: Psi per step on the wire, full gradients held until the schedule ends.
`overlap_param_gather=True, module=model` (Megatron's; off by default, and not offered by
the engine) leaves the step's all-gather in flight until the next forward reads each unit
(`param_gather.py`, which lists who waits for it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
from torch.autograd import Variable

from tinyscale.zero.optimizer import OptimizerFactory, ShardedOptimizer


class ZeroStage2:
    """Sharded optimizer and gradients; bucketed reduce-scatter launched from gradient hooks."""

    def __init__(self, params_or_groups, make_optimizer: OptimizerFactory, process_group=None,
                 bucket_bytes: int = 500_000_000, overlap: bool = True,
                 offload_optimizer: str = "none", nvme_path: str | None = None,
                 param_dtype: torch.dtype | None = None, loss_scaler=None, sub_group_size: int | None = None,
                 pin_memory: bool = False, first_bucket_bytes: int | None = None,
                 overlap_param_gather: bool = False, module: torch.nn.Module | None = None):
        """`first_bucket_bytes`: the first bucket's cap, if smaller than `bucket_bytes`: torch
        DDP's layout (1 MiB, then 25 MiB), so that one reduce-scatter starts early in backward
        even when the rest of the model fits one bucket. None: every bucket `bucket_bytes`.
        `overlap_param_gather` (Megatron's; needs `module`, the model holding the parameters):
        the step's all-gather is left in flight and each unit waited for by the first module
        that reads it (`param_gather.py`; other readers call `wait_params()`)."""
        self.sharded = ShardedOptimizer(params_or_groups, make_optimizer, process_group,
                                        unit_bytes=bucket_bytes, reverse_units=True,
                                        first_unit_bytes=first_bucket_bytes,
                                        offload=offload_optimizer, nvme_path=nvme_path,
                                        param_dtype=param_dtype, loss_scaler=loss_scaler, sub_group_size=sub_group_size,
                                        pin_memory=pin_memory)
        self.overlap = overlap
        self.sharded.flat_params = True  # the step's all-gather writes into the parameters (params_flat)
        self._where = {p: (u, i) for u, unit in enumerate(self.sharded.units) for i, p in enumerate(unit.params)}
        self._sizes = [len(unit.params) for unit in self.sharded.units]
        self._ready: list[set[int]] = [set() for _ in self.sharded.units]
        self._pending: list = []
        self._next = 0
        self._queued = False
        self._flat: list[torch.Tensor | None] = [None] * len(self.sharded.units)  # buckets being filled
        self._deferred = False  # inside no_sync(): gradients accumulate, nothing is sent
        self.events: list[tuple[str, int | None, float]] = []
        self._usage: tuple | None = None  # (counts, handle): see agree_usage_early
        for p in self._where:
            p.register_post_accumulate_grad_hook(self._on_grad)
        self._gather_hooks = []
        if overlap_param_gather:
            if module is None:
                raise ValueError("overlap_param_gather=True needs module=the model: its modules wait for "
                                 "their parameters' all-gathers before forward reads them")
            from tinyscale.zero.param_gather import install_param_gather_hooks
            self._gather_hooks = install_param_gather_hooks(self.sharded, module)
            self.sharded.overlap_param_gather = True

    def wait_params(self) -> None:
        """overlap_param_gather: complete every parameter all-gather in flight (before reading the
        parameters other than through the module's forward or state_dict)."""
        self.sharded.wait_params()

    # --8<-- [start:hook]
    def _on_grad(self, param: torch.Tensor) -> None:
        # Kept lean: it runs once per gradient in Python, where torch DDP's hook is C++. Small GPT
        # (39 gradients), one process, 2026-11-27: 2.2 ms of CPU a step, copies and launches
        # included, before (a no_grad decorator per call, the ready loop walked
        # per gradient, stage 1 keeping .grad as a view until the launch), 1.4 to 1.6 after.
        if torch.is_grad_enabled():  # backward(create_graph=True): keep the bookkeeping out of the graph
            with torch.no_grad():
                return self._on_grad(param)
        if self._deferred:  # no_sync: the full gradient stays in .grad until reduce_gradients
            self.sharded.mark_used(param)
            return
        if not self._queued:  # first gradient of this backward: finish when backward ends
            self._queued = True
            self.events = []
            Variable._execution_engine.queue_callback(self._on_backward_end)
        u, i = self._where[param]
        self.sharded.mark_used(param)
        if u >= self._next:  # (a bucket already launched: its gradient waits in .grad for the next)
            self._fill(u, i, param)
        ready = self._ready[u]
        ready.add(i)
        if self.overlap and u == self._next and len(ready) == self._sizes[u]:  # (only the next bucket's can)
            while self._next < len(self._ready) and len(self._ready[self._next]) == self._sizes[self._next]:
                self._launch(self._next)

    def _fill(self, u: int, i: int, param: torch.Tensor) -> None:
        """Move param's gradient into its slot of bucket u's flat buffer and free it."""
        unit = self.sharded.units[u]
        if self._flat[u] is None:
            self._flat[u] = torch.empty(unit.padded_numel, dtype=unit.dtype, device=unit.device)
            self._flat[u][unit.numel:].zero_()  # padding
        slot = self._flat[u][unit.offsets[i]: unit.offsets[i] + unit.shapes[i].numel()]
        if i in self._ready[u]:  # a second gradient in one backward (the parameter used twice)
            slot.add_(param.grad.reshape(-1))
        else:
            slot.copy_(param.grad.reshape(-1))
        param.grad = None

    def _launch(self, u: int) -> None:
        unit, flat = self.sharded.units[u], self._flat[u]
        if flat is None:  # no_sync / reduce_gradients: the accumulated .grad, flattened
            for p in unit.params:  # a .grad set outside backward (no hook ran) counts as used too
                if p.grad is not None:
                    self.sharded.mark_used(p)
            work = self.sharded.reduce_scatter_into(u, [p.grad for p in unit.params], async_op=True)
        else:
            for i, (p, shape) in enumerate(zip(unit.params, unit.shapes)):
                if i not in self._ready[u]:  # no gradient this backward: what .grad holds, or zeros
                    slot = flat[unit.offsets[i]: unit.offsets[i] + shape.numel()]
                    if p.grad is None:
                        slot.zero_()
                    else:  # set outside backward (no hook ran): it counts as used, as in one process
                        slot.copy_(p.grad.reshape(-1))
                        self.sharded.mark_used(p)
            work = self.sharded.reduce_scatter_into(u, None, async_op=True, flat=flat)
            self._flat[u] = None
        self._pending.append(work)
        for p in unit.params:
            p.grad = None  # the bucket's flat buffer is on the wire; the full gradient is not kept
        self.events.append(("launch", u, time.perf_counter()))
        self._next = u + 1
    # --8<-- [end:hook]

    # Which parameters got a gradient anywhere is agreed by an all-reduce launched when each
    # reducing backward ends, behind the last bucket, and waited for in `step`, instead of a
    # blocking one there (stage 2, which blocked, took 8.7 ms a step() to stage 1's 6.7 on 2
    # gloo ranks, small GPT, 2026-11-27; that was the difference in code). Under gradient
    # accumulation each backward's launch supersedes the one before (waited for, long landed):
    # one small all-reduce per micro-batch. The engine turns it off: its loss all-reduce carries
    # the flags.
    agree_usage_early: bool = True

    @torch.no_grad()
    def _on_backward_end(self) -> None:
        self.events.append(("backward_end", None, time.perf_counter()))
        # Buckets whose gradients did not all arrive (unused parameters) or were held back
        # (overlap=False) go now, in order; a missing gradient counts as zero.
        for u in range(self._next, len(self.sharded.units)):
            self._launch(u)
        if self.agree_usage_early:
            self._usage_agreed()  # an earlier backward's, superseded
            self._usage = self.sharded.agree_used_async()
        self._settle()

    def _usage_agreed(self) -> torch.Tensor | None:
        """The flags launched by `_on_backward_end` (bool per parameter), or None."""
        if self._usage is None:
            return None
        (counts, work), self._usage = self._usage, None
        if work is not None:
            work.wait()
        return counts.cpu() > 0

    def _settle(self) -> None:
        """Wait for every launched reduce-scatter and make ready for the next backward."""
        for pending in self._pending:
            pending.wait()
        self._pending.clear()
        for ready in self._ready:
            ready.clear()
        self._next = 0
        self._queued = False

    # --8<-- [start:no-sync]
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate full gradients locally and send nothing; `reduce_gradients`
        then reduce-scatters every bucket once. A pipeline schedule runs its micro-batches'
        backwards under it (torchtitan's FSDP with a pipeline does the same): Psi on the wire per
        step instead of Psi per micro-batch, for full gradients held until the schedule ends."""
        self._deferred = True
        try:
            yield
        finally:
            self._deferred = False

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter every bucket's accumulated gradients into this rank's shards, in
        order (a missing gradient counts as zero), and free the full ones."""
        for u in range(len(self.sharded.units)):
            self._launch(u)
        self._settle()
    # --8<-- [end:no-sync]

    def abandon_backward(self) -> None:
        """Forget a forward or backward that raised (autograd then drops the end callback):
        let what was launched land, then drop every gradient of the step, full and sharded."""
        if self._queued:
            self._settle()
        self._usage_agreed()  # (in flight: let it land)
        self.sharded.wait_params()
        for unit in self.sharded.units:
            for p in unit.params:
                p.grad = None
        self.sharded.grad = [None] * len(self.sharded.grad)
        self._flat = [None] * len(self._flat)
        self.sharded.forget_usage()

    def complete_abandoned(self, micro_batches_left: int) -> bool:
        """After this rank's forward or backward raised (its step to be dropped), make the
        reduce-scatters the other ranks make in the rest of the step: every bucket, in order,
        in each backward left (the failed one's from where it stopped). Returns True."""
        if self._queued:  # failed inside a backward: its remaining buckets
            self._on_backward_end()
            micro_batches_left -= 1
        for _ in range(micro_batches_left):
            self._queued = True
            self._on_backward_end()
        self.abandon_backward()
        return True

    def step(self, max_norm: float = 0.0, used: torch.Tensor | None = None) -> bool:
        """Clip and step; returns True if fp16 overflow skipped it (on every rank). `used`:
        see `ZeroStage1.step`."""
        early = self._usage_agreed()
        return self.sharded.full_step(max_norm, used=early if used is None else used)

    def set_lr(self, lr: float) -> None:
        self.sharded.set_lr(lr)
