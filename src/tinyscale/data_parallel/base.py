"""What every data-parallel wrapper shares: the module, the group, `no_sync`, and knowing
when backward has finished.

A wrapper hears about each gradient from a post-accumulate-grad hook (called once per
parameter per backward, after autograd has summed every use of the parameter into
``.grad``, so a parameter used twice, or a tied weight, is seen once). The first hook of a
backward also queues a callback on the autograd engine that runs when the whole backward
is done: that is where a wrapper finishes synchronising. torch's DDP works the same way.

`no_sync()` turns synchronisation off for the micro-batches of gradient accumulation:
their gradients accumulate locally in ``.grad``, and the backward of the last
micro-batch, outside `no_sync`, synchronises the accumulated sum once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from tinyscale.dist import comm


# --8<-- [start:broadcast]
# torch's DDP value (DistributedDataParallel.broadcast_bucket_size): one flat copy of at most this
# many bytes per bucket is the memory coalescing costs while a broadcast is in flight.
BROADCAST_BUCKET_BYTES = 250 * 2**20


@torch.no_grad()
def broadcast_parameters(module: nn.Module, process_group=None) -> None:
    """Copy the group's first rank's parameters and buffers to every rank of the group, coalesced as
    torch's DDP does at construction: one broadcast per bucket (`_broadcast_buckets`), not per tensor."""
    for group, tensors in _broadcast_buckets(module, process_group):
        src = dist.get_global_rank(group, 0) if group is not None else 0
        flat = torch.cat([t.reshape(-1) for t in tensors])  # (sum of numels,), a copy: strides do not matter
        comm.broadcast(flat, src=src, group=group)
        if dist.get_rank() != src:  # the source holds these values already
            for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(piece.view(t.shape))


def _broadcast_buckets(module: nn.Module, process_group) -> list[tuple[object, list[torch.Tensor]]]:
    """[(group, tensors)]: every parameter and buffer once, by (group, dtype, device), in buckets of at
    most BROADCAST_BUCKET_BYTES (a bigger tensor alone), in the order their first tensor appears.
    Every rank holds the same model, so every rank makes the same buckets in the same order."""
    buckets, open_bucket = [], {}  # open_bucket: (group, dtype, device) -> [tensors, bytes]
    for t in [*module.parameters(), *module.buffers()]:
        shard = getattr(t, "expert_shard", None)  # an expert shard: the same experts' ranks (moe/parallel.py)
        group = shard.group if shard is not None else process_group
        key, size = (group, t.dtype, t.device), t.numel() * t.element_size()
        bucket = open_bucket.get(key)
        if bucket is None or bucket[1] + size > BROADCAST_BUCKET_BYTES:
            bucket = open_bucket[key] = [[], 0]
            buckets.append((group, bucket[0]))
        bucket[0].append(t)
        bucket[1] += size
    return buckets
# --8<-- [end:broadcast]


def all_reduce_in(buffer: torch.Tensor, dtype: torch.dtype | None, group):
    """Start the sum of `buffer` over `group`, sent in `dtype`; wait() leaves it in `buffer` (a
    bucket of BucketedDDP, an expert shard's gradient)."""
    if dtype is None or dtype == buffer.dtype:
        return comm.all_reduce(buffer, group=group, async_op=True)
    wire = buffer.to(dtype)  # the usage flags too: counts up to N are exact in fp16 and bf16 (N <= 256)
    return _CastBack(comm.all_reduce(wire, group=group, async_op=True), wire, buffer)


class _CastBack:
    """An all-reduce of a cast copy: wait() copies the sum back into the bucket's own dtype."""

    def __init__(self, work, wire: torch.Tensor, buffer: torch.Tensor):
        self._work, self._wire, self._buffer = work, wire, buffer

    def wait(self) -> None:
        self._work.wait()
        self._buffer.copy_(self._wire)


class DataParallelBase(nn.Module):
    """Shared plumbing; subclasses implement `_grad_ready(param)` and `_finish_backward()`."""

    # --8<-- [start:init]
    def __init__(self, module: nn.Module, process_group=None, find_unused_parameters: bool = False):
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        # Accepted for torch's signature; unused parameters are always found (see subclasses).
        self.find_unused_parameters = find_unused_parameters
        # Frozen parameters take no part; model.parameters() already lists a tied weight once.
        self.params = [p for p in module.parameters() if p.requires_grad and not hasattr(p, "expert_shard")]
        # expert shards (tinyscale.moe.shard_experts): different experts on different ranks,
        # summed over their own group after the others' synchronisation (`_reduce_expert_shards`)
        self.expert_params = [p for p in module.parameters() if p.requires_grad and hasattr(p, "expert_shard")]
        self.names = {p: n for n, p in module.named_parameters() if p.requires_grad}
        self._sync = True
        self._finish_queued = False
        # Ranks must start identical; torch DDP makes it so the same way.
        broadcast_parameters(module, process_group)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        for p in self.expert_params:  # expert shards only start the end-of-backward callback
            p.register_post_accumulate_grad_hook(self._on_expert_grad_ready)  # (a model may train only its experts)
    # --8<-- [end:init]

    def forward(self, *args, **kwargs):
        if self._finish_queued:
            # The last synchronising backward raised midway: autograd dropped our
            # end-of-backward callback. Without this reset no backward would ever finish
            # synchronising again, and the replicas would drift apart silently.
            self._finish_queued = False
            self._abandon_backward()
        return self.module(*args, **kwargs)

    # --8<-- [start:no_sync]
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside this block synchronises.

        The flag is read during *backward* (when gradients arrive). torch's DDP reads it
        during forward: run forward and backward inside the same block and the two agree.
        """
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous  # restored even if the forward or backward raised
    # --8<-- [end:no_sync]

    def sync_gradients(self) -> None:
        """Synchronise what ``.grad`` holds now, once: after backwards run under `no_sync()`
        whose gradients do not all pass autograd's hooks (a pipeline schedule's zero-bubble W
        passes write ``.grad`` themselves), the engine calls this after the last of them."""
        self._finish_backward()
        self._reduce_expert_shards()

    # --8<-- [start:hooks]
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync:
            return
        if not self._finish_queued:
            self._queue_finish()
        self._grad_ready(param)

    def _on_expert_grad_ready(self, param: torch.Tensor) -> None:
        if self._sync and not self._finish_queued:
            self._queue_finish()

    def _queue_finish(self) -> None:
        """The first gradient of a synchronising backward: finish when the whole backward is done."""
        self._finish_queued = True
        self._backward_started()
        Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        self._finish_queued = False
        self._finish_backward()
        self._reduce_expert_shards()
    # --8<-- [end:hooks]

    # --8<-- [start:expert-shards]
    # DeepSpeed's communication_data_type (the engine sets it): each bucket (BucketedDDP) and each
    # expert shard, already divided, is cast to this dtype for its all-reduce and the sum cast back;
    # fp16/bf16 halve the bytes and round each rank's term and the sum. None: the gradients' dtype.
    # (A comm hook, when registered, sends what it decides instead.)
    comm_dtype: torch.dtype | None = None
    # DeepSpeed's prescale_gradients / gradient_predivide_factor (the engine sets them): true
    # divides by N before the all-reduce (the default here); false by the factor before and by
    # N / factor after (DeepSpeed's default, factor 1: sum, then divide).
    prescale_gradients: bool = True
    gradient_predivide_factor: float = 1.0

    def _pre_post(self, n: int) -> tuple[float, float]:
        """(divide before, divide after) the sum of a mean over n ranks."""
        pre = n if self.prescale_gradients else self.gradient_predivide_factor
        return pre, n / pre

    @torch.no_grad()
    def _reduce_expert_shards(self) -> None:
        """Expert shards (expert parallelism): each averaged over dp, summed over the ranks holding
        the same experts (every dp rank's tokens reached them through one of the ep groups). As the
        buckets: divided by dp (prescale_gradients) or by the predivide factor before the sum and
        by dp / factor after it, and summed in `comm_dtype`."""
        for p in self.expert_params:
            shard = p.expert_shard
            if p.grad is None:  # the peers send theirs: keep the collectives matched
                p.grad = torch.zeros_like(p)
            pre, post = self._pre_post(shard.mean_over)
            p.grad.div_(pre)
            if dist.get_world_size(shard.group) > 1:
                all_reduce_in(p.grad, self.comm_dtype, shard.group).wait()
            if post != 1:
                p.grad.div_(post)
    # --8<-- [end:expert-shards]

    def _backward_started(self) -> None:
        """Hook for subclasses: the first gradient of a synchronising backward arrived."""

    def _abandon_backward(self) -> None:
        """Hook for subclasses: forget the state of a backward that never finished."""

    def _grad_ready(self, param: torch.Tensor) -> None:
        raise NotImplementedError

    def _finish_backward(self) -> None:
        raise NotImplementedError

    # --8<-- [start:used-anywhere]
    def _used_anywhere(self, used_here: list[bool]) -> list[bool]:
        """Which parameters got a gradient on at least one rank (one small all-reduce)."""
        device = self.params[0].device if self.params else torch.device("cpu")
        # in the gradients' dtype, as the flags BucketedDDP sends in its last bucket: a sum of
        # ones (any dtype, even rounded) is positive exactly when some rank used the parameter
        dtype = self.params[0].dtype if self.params else torch.float32
        flags = torch.tensor(used_here, dtype=dtype, device=device)
        comm.all_reduce(flags, group=self.process_group)
        return [bool(f) for f in flags.tolist()]
    # --8<-- [end:used-anywhere]
