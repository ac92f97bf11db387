"""ZeRO stage 1: optimizer states (and master weights) sharded; gradients and parameters full.

    zero = ZeroStage1(model.parameters(), make_optimizer, process_group=group)
    for i, micro in enumerate(micro_batches):   # all but the last backward under no_sync()
        with zero.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (model(*micro) / n).backward()
    zero.step()     # step my shard, all-gather parameters

Memory per rank (Psi parameters, N ranks, B bytes per element, K optimizer bytes per element):
parameters B*Psi + gradients B*Psi + (master + optimizer state) K*Psi/N, the last term
being what stage 1 saves: with Adam in fp32 (K = 8 here; 12 with fp32 master weights in
mixed precision) most of the memory.

Communication: gradients are **reduce-scattered**, not all-reduced: each rank steps only
its shard, so it only needs that shard of the averaged gradient (Psi elements on the wire
per rank, the first half of an all-reduce). Then each rank's updated shard is
**all-gathered** into everyone's full parameters (Psi, the second half). Total 2 Psi: the
same as DDP's all-reduce, split in two with the optimizer step in the middle. (An
implementation that all-reduces gradients AND all-gathers parameters moves 3 Psi.)

The reduce-scatter happens once per step, in the last micro-batch's backward (DeepSpeed's
stage 1 does the same: its stages 1 and 2 share the bucketed reduction, and stage 1 reduces
at the accumulation boundary only): the backwards before it run under `no_sync()` and only
accumulate, as under DDP. The gradients live in each unit's flat buffer (`grad_flat`,
allocated at the step's first gradient): when autograd hands a parameter its gradient, a
hook copies it into the parameter's slot and makes ``.grad`` a view of that slot, so later
micro-batches accumulate straight into the buffer and the reduce-scatter sends it as it is
(no second, flattened copy). The last backward launches each unit's reduce-scatter as soon
as its gradients are all in (`overlap=True`, the engine's ``overlap_comm``; units are
buckets of ``bucket_bytes``, last layers first, the first one `first_bucket_bytes`), so the
communication overlaps the rest of backward, as stage 2's does; `overlap=False` holds every
unit until that backward ends. A step whose backwards all ran under `no_sync()` reduces in
`step()`. After the step the buffers are freed and ``.grad`` is None: between steps no
gradient is held.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tinyscale.zero.optimizer import OptimizerFactory
from tinyscale.zero.stage2 import ZeroStage2


class ZeroStage1(ZeroStage2):
    """Sharded optimizer over full, replicated parameters and full local gradients, reduced
    by the last micro-batch's backward (stage 2's bucketed hooks; the others run under `no_sync`)."""

    def __init__(self, params_or_groups, make_optimizer: OptimizerFactory, process_group=None,
                 offload_optimizer: str = "none", nvme_path: str | None = None,
                 param_dtype: torch.dtype | None = None, loss_scaler=None, bucket_bytes: int | None = None,
                 sub_group_size: int | None = None, pin_memory: bool = False, overlap: bool = True,
                 first_bucket_bytes: int | None = None, overlap_param_gather: bool = False,
                 module: torch.nn.Module | None = None):
        """`bucket_bytes` (the engine: ``reduce_bucket_size``): the gradients are reduce-scattered
        in units of at most that many bytes; None: one unit per parameter group (with
        `first_bucket_bytes`: that much first, then the rest)."""
        # (ZeroStage2's methods are named, not super(): exercise mode swaps this class's methods)
        ZeroStage2.__init__(self, params_or_groups, make_optimizer, process_group, bucket_bytes=bucket_bytes,
                            overlap=overlap, offload_optimizer=offload_optimizer, nvme_path=nvme_path,
                            param_dtype=param_dtype, loss_scaler=loss_scaler, sub_group_size=sub_group_size,
                            pin_memory=pin_memory, first_bucket_bytes=first_bucket_bytes,
                            overlap_param_gather=overlap_param_gather, module=module)
        self._held = False  # gradients accumulated under no_sync and not reduced yet

    @property
    def grad_flat(self) -> list[torch.Tensor | None]:
        """Each unit's flat gradient buffer (None: no gradient in it this step, or sent)."""
        return self._flat

    def _slot(self, u: int, i: int) -> torch.Tensor:
        """Parameter i of unit u's slot in the unit's flat gradient buffer (allocated here if the step has none yet)."""
        unit = self.sharded.units[u]
        if self._flat[u] is None:
            self._flat[u] = torch.empty(unit.padded_numel, dtype=unit.dtype, device=unit.device)
            self._flat[u][unit.numel:].zero_()  # padding: zeros in the sum
        return self._flat[u][unit.offsets[i]: unit.offsets[i] + unit.shapes[i].numel()].view(unit.shapes[i])

    # --8<-- [start:reduce]
    def _on_grad(self, p: torch.Tensor) -> None:
        """p got a gradient: the first one of a step (autograd's own tensor) moves into p's slot
        and .grad becomes that view, so the next micro-batches' gradients are added into the flat
        buffer in place. Under no_sync that is all; in the step's last backward, each unit goes
        on the wire as soon as all its gradients are in (ZeroStage2._on_grad)."""
        if torch.is_grad_enabled():  # backward(create_graph=True): keep the copies out of the graph
            with torch.no_grad():
                return self._on_grad(p)
        if self._deferred:
            self.sharded.mark_used(p)
            self._keep_in_slot(p)
            return
        ZeroStage2._on_grad(self, p)

    def _in_slot(self, u: int, i: int, grad: torch.Tensor) -> bool:
        """Whether `grad` is parameter i of unit u's slot: its address compared, no view made
        (a no_sync hook after the first micro-batch does only this and `mark_used`: 3.2 us a
        call, where making the slot's view to compare took 8.3; small GPT, one process, 400
        interleaved blocks of its 39 parameters, 2026-11-27, load 3)."""
        flat = self._flat[u]
        return flat is not None and grad.data_ptr() == \
            flat.data_ptr() + self.sharded.units[u].offsets[i] * flat.element_size()

    def _keep_in_slot(self, p: torch.Tensor) -> None:
        u, i = self._where[p]
        if not self._in_slot(u, i, p.grad):
            slot = self._slot(u, i)
            slot.copy_(p.grad)
            p.grad = slot

    def _fill(self, u: int, i: int, param: torch.Tensor) -> None:
        """The last backward: a gradient that the no_sync backwards accumulated in its slot stays
        there (the launch frees .grad); autograd's own moves into its slot and is freed (ZeroStage2._fill)."""
        if not self._in_slot(u, i, param.grad):
            ZeroStage2._fill(self, u, i, param)

    def _launch(self, u: int) -> None:
        """Send unit u's flat buffer; a parameter without a gradient in it counts as zero."""
        unit, filled = self.sharded.units[u], self._ready[u]
        if self._flat[u] is None:  # no gradient in its slots yet: zeros first, then what .grad holds
            self._slot(u, 0)  # (a slot left as torch.empty made it would send garbage)
            self._flat[u][:unit.numel].zero_()
        for i, p in enumerate(unit.params):
            if i in filled:  # its hook in this backward just put it in its slot
                continue
            if p.grad is None:
                self._slot(u, i).zero_()
            else:  # set or replaced outside backward's hook: copy it in; it has a gradient, so it is used
                self._keep_in_slot(p)
                self.sharded.mark_used(p)
        self._ready[u].update(range(len(unit.params)))  # every slot is filled: ZeroStage2 copies nothing
        self._held = False
        ZeroStage2._launch(self, u)
    # --8<-- [end:reduce]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside only accumulate (in the flat buffers); the next backward outside, or
        else `step()`, reduce-scatters the sum once."""
        self._held = True  # set by the caller's code, the same on every rank: step() agrees on it
        self._usage_agreed()  # flags agreed before this backward are stale: step() agrees anew
        with ZeroStage2.no_sync(self):
            yield

    def step(self, max_norm: float = 0.0, used: torch.Tensor | None = None) -> bool:
        """Reduce what no backward reduced (every backward under no_sync), clip, step; returns
        True if fp16 overflow skipped it (on every rank).

        `used`: the parameters that got a gradient on some rank, if already agreed
        (`ShardedOptimizer.full_step`); those that got none are not stepped."""
        if self._held:
            self.reduce_gradients()
        early = self._usage_agreed()
        return self.sharded.full_step(max_norm, used=early if used is None else used)

    def abandon_backward(self) -> None:
        """Forget the gradients of a step that raised, full and sharded."""
        ZeroStage2.abandon_backward(self)
        self._held = False

    def complete_abandoned(self, micro_batches_left: int) -> bool:
        """After this rank's forward or backward raised (its step to be dropped), make the
        reduce-scatters the other ranks make in the rest of the step: the last backward's,
        every unit in order (from where it stopped, if it failed inside it). Returns True."""
        if not self._queued:
            self._queued = True
        self._on_backward_end()
        self.abandon_backward()
        return True
