"""ZeRO stage 1: optimizer states (and master weights) sharded; gradients and parameters full.

    zero = ZeroStage1(model.parameters(), make_optimizer, process_group=group)
    for micro in micro_batches: (model(*micro) / n).backward()   # plain local backward
    zero.step()     # reduce-scatter grads, step my shard, all-gather parameters

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

The reduce-scatter happens once per step, after the last micro-batch's backward: a rank
holds its full local gradient until then (what stage 2 removes). It holds it in the unit's
flat buffer (`grad_flat`, allocated at the step's first gradient): when autograd hands a
parameter its gradient, a hook copies it into the parameter's slot and makes ``.grad`` a view
of that slot, so later micro-batches accumulate straight into the buffer and the
reduce-scatter sends the buffer as it is (no second, flattened copy of the gradient). After
the step the buffers are freed and ``.grad`` is None: between steps no gradient is held.
"""

from __future__ import annotations

import torch

from tinyscale.zero.optimizer import OptimizerFactory, ShardedOptimizer


class ZeroStage1:
    """Sharded optimizer over full, replicated parameters and full local gradients."""

    def __init__(self, params_or_groups, make_optimizer: OptimizerFactory, process_group=None,
                 offload_optimizer: str = "none", nvme_path: str | None = None,
                 param_dtype: torch.dtype | None = None, loss_scaler=None, bucket_bytes: int | None = None,
                 sub_group_size: int | None = None, pin_memory: bool = False):
        """`bucket_bytes` (the engine: ``reduce_bucket_size``): the gradients are reduce-scattered
        in units of at most that many bytes, one after another, so the flat copy of the
        gradient being sent never exceeds it; None: one unit per parameter group."""
        # Each rank owns 1/N of every unit's flat buffer.
        self.sharded = ShardedOptimizer(params_or_groups, make_optimizer, process_group, unit_bytes=bucket_bytes,
                                        offload=offload_optimizer, nvme_path=nvme_path,
                                        param_dtype=param_dtype, loss_scaler=loss_scaler, sub_group_size=sub_group_size,
                                        pin_memory=pin_memory)
        # Each unit's gradients live in one padded flat buffer, from the step's first gradient to its end.
        self.grad_flat: list[torch.Tensor | None] = [None] * len(self.sharded.units)
        self._where = {p: (u, i) for u, unit in enumerate(self.sharded.units) for i, p in enumerate(unit.params)}
        for p in self.sharded.params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _slot(self, p: torch.Tensor) -> torch.Tensor:
        """p's slot in its unit's flat gradient buffer (allocated here if the step has none yet)."""
        u, i = self._where[p]
        unit = self.sharded.units[u]
        if self.grad_flat[u] is None:
            self.grad_flat[u] = torch.empty(unit.padded_numel, dtype=unit.dtype, device=unit.device)
            self.grad_flat[u][unit.numel:].zero_()  # padding: zeros in the sum
        return self.grad_flat[u][unit.offsets[i]: unit.offsets[i] + unit.shapes[i].numel()].view(unit.shapes[i])

    # --8<-- [start:reduce]
    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        """p got a gradient (marked used: unused ones are not stepped); the first one of a step
        (autograd's own tensor) moves into p's slot and .grad becomes that view, so the next
        micro-batches' gradients are added into the flat buffer in place."""
        self.sharded.mark_used(p)
        slot = self._slot(p)
        if p.grad.data_ptr() != slot.data_ptr():
            slot.copy_(p.grad)
            p.grad = slot

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average the accumulated local gradients into this rank's shards; free the full ones."""
        for i, unit in enumerate(self.sharded.units):
            for p in unit.params:  # a gradient set or replaced outside backward's hook: copy it in
                slot = self._slot(p)
                if p.grad is None:
                    slot.zero_()  # no gradient here: zeros in the sum
                elif p.grad.data_ptr() != slot.data_ptr():
                    slot.copy_(p.grad)
            self.sharded.reduce_scatter_into(i, None, flat=self.grad_flat[i]).wait()
            self.grad_flat[i] = None
            for p in unit.params:
                p.grad = None
    # --8<-- [end:reduce]

    def abandon_backward(self) -> None:
        """Forget the gradients of a step that raised (stage 1 communicates only in `step`)."""
        for p in self.sharded.params:
            p.grad = None
        self.grad_flat = [None] * len(self.grad_flat)
        self.sharded.forget_usage()

    def complete_abandoned(self, micro_batches_left: int) -> bool:
        """Stage 1 makes no collective during forward or backward: nothing to match."""
        return True

    def step(self, max_norm: float = 0.0, used: torch.Tensor | None = None) -> bool:
        """Reduce, clip, step; returns True if fp16 overflow skipped it (on every rank).

        `used`: the parameters that got a gradient on some rank, if already agreed
        (`ShardedOptimizer.full_step`); those that got none are not stepped."""
        self.reduce_gradients()
        return self.sharded.full_step(max_norm, used=used)

    def set_lr(self, lr: float) -> None:
        self.sharded.set_lr(lr)
