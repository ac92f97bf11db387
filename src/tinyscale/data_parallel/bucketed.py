"""BucketedDDP: gradients packed into buckets whose all-reduce starts while backward still runs.

    model = BucketedDDP(model, process_group=group, bucket_cap_mb=25)
    loss = model(x, y); loss.backward()        # averaged gradients when backward returns

What it changes from `naive.py`:

1. **Buckets.** Parameters are packed, in *reverse* registration order, into flat buffers
   of at most ``bucket_cap_mb``. Backward produces gradients roughly in reverse order of
   the forward, so the first bucket fills first. One all-reduce per bucket instead of one
   per parameter: a few large messages instead of hundreds of small ones, each paying the
   collective's latency once. ``first_bucket_cap_mb=1`` gives torch DDP's layout (its
   default): a small first bucket that goes early, then few large ones (on 2 CPU cores each
   extra message costs milliseconds of gloo's thread work on the backward's core: lesson 02).
2. **Overlap.** A gradient hook marks each gradient ready as soon as autograd has it; when
   a bucket is full, its gradients go in (one `torch.cat` into the bucket) and its all-reduce
   is *launched asynchronously*, and backward carries on computing earlier layers' gradients
   while the bytes move.
3. **Order.** Buckets are launched strictly in index order (a full bucket waits for the
   ones before it). Every rank must issue the same collectives in the same order, and
   gradient readiness can differ between ranks; a fixed launch order keeps them matched.

Each gradient is divided by the world size *before* the all-reduce (as torch's DDP does: in
fp16 a sum of N gradients can overflow where their mean would not; `pytest -k
overflow_safe_reduce`): one `div_` over the bucket once its gradients are in (`_pack`). Two
operations a bucket, where a copy per gradient in each hook made 39 a step on the small GPT:
every operation launched from Python between autograd's kernels costs far more than its bytes
(lesson 02, "Four ranks"). When backward ends, the wrapper waits for every bucket, and each
``.grad`` becomes a view of its slot in the bucket (``gradient_as_bucket_view``, default on,
as torch's DDP offers): no copy out, no second copy of the gradients in memory, and while
``.grad`` stays that view (``zero_grad(set_to_none=False)``, or accumulation) autograd
accumulates straight into the bucket, so the copy in goes too. ``gradient_as_bucket_view=
False`` gives each parameter a ``.grad`` of its own, cloned from the bucket. `events` records
when each bucket was launched and when backward ended, so a test (and the lesson's timeline)
can see the overlap.

Shape legend: each bucket's ``buffer`` is 1-D, holding its parameters' gradients
flattened and concatenated in bucket order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tinyscale.data_parallel.base import DataParallelBase, all_reduce_in
from tinyscale.dist import comm


@dataclass
class Bucket:
    params: list[torch.Tensor]
    offsets: list[int]  # start of each param's gradient in `buffer`
    buffer: torch.Tensor  # (sum of numels,) flat gradients
    ready: set[int] = field(default_factory=set)  # ids of params whose gradient is in
    work: comm.Work | None = None
    views: list[torch.Tensor] = field(default_factory=list)  # slot i, shaped as param i (made once)
    flag_index: list[int] = field(default_factory=list)  # param i's place in the usage flags
    gradients: torch.Tensor = field(init=False)  # buffer[:sum of numels]: the gradients without the usage flags

    def __post_init__(self):
        self.views = [self.buffer[o: o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]
        self.gradients = self.buffer[: self.offsets[-1] + self.params[-1].numel()]

    @property
    def full(self) -> bool:
        return len(self.ready) == len(self.params)

    def slot(self, i: int) -> torch.Tensor:
        return self.views[i]


# torch DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES): the engine's ZeRO 0
# caps its first bucket so (when it overlaps), the rest in buckets of reduce_bucket_size.
TORCH_FIRST_BUCKET_MB = 1.0


# --8<-- [start:assign]
def assign_buckets(params: list[torch.Tensor], cap_bytes: int,
                   first_cap_bytes: int | None = None) -> list[list[torch.Tensor]]:
    """Pack parameters, last registered first, into groups of at most `cap_bytes`; if
    `first_cap_bytes` is given, the first group (the first to fill in backward) closes as soon
    as it holds that many bytes (torch DDP's 1 MiB first bucket: communication starts early, the
    rest goes in few large messages).

    The first group fills as torch's do: the parameter that crosses `first_cap_bytes` still goes
    in (still within `cap_bytes`). So the last group, whose all-reduce can only start when
    backward has ended, holds what torch's does: on the small GPT 1,115,648 bytes go first and
    2,362,368 last, where stopping short of 1 MiB left 2,542,592 to the last (lesson 02).
    A bucket holds one dtype on one device (it is one flat buffer); a parameter larger than
    the cap gets a bucket of its own.
    """
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        current = buckets[-1] if buckets else None
        first_full = first_cap_bytes is not None and len(buckets) == 1 and size >= first_cap_bytes
        if (current is None or first_full or size + nbytes > cap_bytes
                or p.dtype != current[0].dtype or p.device != current[0].device):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets
# --8<-- [end:assign]


class BucketedDDP(DataParallelBase):
    """Data parallelism with bucketed, asynchronous all-reduces launched during backward."""


    def __init__(self, module, process_group=None, bucket_cap_mb: float = 25.0,
                 find_unused_parameters: bool = False, overlap: bool = True, gradient_as_bucket_view: bool = True,
                 first_bucket_cap_mb: float | None = None):
        """`overlap=False` holds every launch until backward ends (to measure what overlap buys).
        `gradient_as_bucket_view`: each ``.grad`` is a view of its bucket slot after backward (torch's
        DDP option; a later backward accumulates into it, as into any .grad), else a copy.
        `first_bucket_cap_mb`: the first bucket closes once it holds this much (torch DDP's 1 MiB;
        `assign_buckets`), else it is capped by `bucket_cap_mb` as the others.
        `find_unused_parameters` is accepted for torch's signature and changes nothing: unused
        parameters are always found, by flags that ride in the last bucket's all-reduce."""
        super().__init__(module, process_group, find_unused_parameters)
        self.overlap = overlap
        self.gradient_as_bucket_view = gradient_as_bucket_view
        if bucket_cap_mb <= 0:
            raise ValueError(f"BucketedDDP: bucket_cap_mb must be positive, got {bucket_cap_mb}")
        if first_bucket_cap_mb is not None and first_bucket_cap_mb <= 0:
            raise ValueError(f"BucketedDDP: first_bucket_cap_mb must be positive (or None), got {first_bucket_cap_mb}")
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.buckets = []
        # id(param) -> (its bucket, the bucket's index, its slot): what each hook looks up (an int key:
        # a tensor key would hash through Tensor.__hash__, a Python call, on every gradient)
        self._slot_of: dict[int, tuple[Bucket, int, int]] = {}
        first = None if first_bucket_cap_mb is None else int(min(first_bucket_cap_mb, bucket_cap_mb) * 2**20)
        groups = assign_buckets(self.params, self.bucket_cap_bytes, first)
        for b, group in enumerate(groups):
            offsets, total = [], 0
            for i, p in enumerate(group):
                offsets.append(total)
                total += p.numel()
            # The last bucket carries one more element per parameter: 1 if it got a gradient
            # on this rank, so its all-reduce also says which parameters no rank used.
            extra = len(self.params) if b == len(groups) - 1 else 0
            self.buckets.append(Bucket(group, offsets, torch.zeros(total + extra, dtype=group[0].dtype,
                                                                   device=group[0].device)))
        # (no dense parameter to train, e.g. only an MoE's experts: no buckets, nothing to flag)
        self._flags = self.buckets[-1].buffer[self.buckets[-1].buffer.numel() - len(self.params):] \
            if self.buckets else None
        index = {id(p): k for k, p in enumerate(self.params)}
        for b, bucket in enumerate(self.buckets):
            bucket.flag_index = [index[id(p)] for p in bucket.params]
            for i, p in enumerate(bucket.params):
                self._slot_of[id(p)] = (bucket, b, i)
        self._div = 1.0  # what this backward's gradients are divided by (`_divisor`, at its first hook)
        self._next_launch = 0
        self.events: list[tuple[str, int | None, float]] = []  # ("launch", bucket, t) / ("backward_end", None, t)
        self._comm_hook: tuple[object, Callable] | None = None

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """torch DDP's API: `hook(state, bucket) -> Future[Tensor]` replaces each bucket's
        all-reduce (gradient compression: `tinyscale.compression`). `bucket` offers torch's
        `GradBucket` methods; `bucket.buffer()` holds this rank's gradients, not divided by the
        world size, and the future's value is the averaged bucket. The usage flags then go in a
        small all-reduce of their own, so the hook never compresses them."""
        if self._comm_hook is not None:
            raise RuntimeError("BucketedDDP.register_comm_hook: a hook is registered already (one per model, "
                               "as in torch's DDP)")
        self._comm_hook = (state, hook)

    def _backward_started(self) -> None:
        self.events = []
        self._div = self._divisor()

    def _abandon_backward(self) -> None:
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()  # launched on every rank alike: let it finish, then drop it
            bucket.work = None
            bucket.ready.clear()
        self._next_launch = 0

    @torch.no_grad()
    def complete_abandoned(self) -> None:
        """After this rank's forward or backward raised (its step to be dropped): make the
        all-reduces the other ranks make in their synchronising backward, then forget them.

        Those are every bucket, in order: the ones this rank already launched (if it failed
        inside that backward) and the rest, which go now with whatever they hold."""
        start = self._next_launch if self._finish_queued else 0
        for b in range(start, len(self.buckets)):
            self._launch(b)
        self._reduce_expert_shards()  # the peers' end of backward reduces expert shards next (base.py)
        self._finish_queued = False
        self._abandon_backward()

    # --8<-- [start:grad_ready]
    def bucket_of(self, param: torch.Tensor) -> tuple[int, int] | None:
        """(bucket index, slot in that bucket) of `param`'s gradient; None if no bucket holds it."""
        hit = self._slot_of.get(id(param))
        return None if hit is None else (hit[1], hit[2])

    def _grad_ready(self, param: torch.Tensor) -> None:
        # Runs for every parameter every step, in Python where torch's reducer is C++, between
        # autograd's kernels (cold caches): so no helper calls, no decorator, no tensor-keyed dict,
        # and no tensor operation: the gradient stays in .grad until its bucket is full (lesson 02,
        # "What the hooks' Python costs" and "Four ranks").
        bucket, b, i = self._slot_of[id(param)]
        bucket.ready.add(i)
        if b == self._next_launch and self.overlap and len(bucket.ready) == len(bucket.params):
            # Launch every full bucket that is next in line: a fixed order on every rank.
            while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].full:
                self._pack(self._next_launch, self._div)
                self._launch(self._next_launch)

    def _divisor(self) -> float:
        """What each gradient is divided by on its way into its bucket: N (prescaled), the predivide
        factor, or 1 under a comm hook (which gets this rank's gradients as they are)."""
        return 1.0 if self._comm_hook is not None else self._pre_post(self.world_size)[0]

    @torch.no_grad()  # (under backward(create_graph=True) the gradients require grad: no graph for this)
    def _pack(self, b: int, divisor: float) -> None:
        """Put each parameter's .grad / divisor in its slot of bucket `b` (zero where .grad is None).
        Divide before summing (torch DDP does): in fp16 the sum of N gradients can overflow where
        their mean would not. A full bucket whose gradients are tensors of their own (after
        ``zero_grad(set_to_none=True)``, the usual case) takes two operations, whatever its number
        of parameters: one `cat` into the bucket, one `div_` over it; where every .grad is its slot
        already (autograd accumulated into the bucket itself), the `div_` alone. Either is the
        same arithmetic, bit for bit, as dividing each gradient on its way in (`_fill`)."""
        bucket = self.buckets[b]
        grads = [p.grad for p in bucket.params]
        if len(bucket.ready) == len(bucket.params):
            aliased = [g.data_ptr() == v.data_ptr() for g, v in zip(grads, bucket.views)]
            if not any(aliased):
                torch.cat([g.reshape(-1) for g in grads], out=bucket.gradients)
            if not any(aliased) or all(aliased):
                if divisor != 1:
                    bucket.gradients.div_(divisor)
                return
        for slot, grad in zip(bucket.views, grads):  # a bucket not all ready (unused parameters), or mixed
            self._fill(slot, grad, divisor)

    @staticmethod
    def _fill(slot: torch.Tensor, grad: torch.Tensor | None, divisor: float) -> None:
        """Put grad / divisor in its slot, one parameter: the quotient written on the way in, or,
        where autograd accumulated into the bucket itself, made in place."""
        if grad is None:
            slot.zero_()
        elif grad.data_ptr() != slot.data_ptr():
            torch.div(grad, divisor, out=slot) if divisor != 1 else slot.copy_(grad)
        elif divisor != 1:
            slot.div_(divisor)

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        if b == len(self.buckets) - 1:  # launched last, when this rank's usage is known
            # (the flags, after the gradients, are not divided: they stay counts)
            self._flags.copy_(torch.tensor([p.grad is not None for p in self.params]))
        gradients = bucket.gradients.numel()
        if self._comm_hook is not None:
            flags = None
            if b == len(self.buckets) - 1:
                flags = comm.all_reduce(self._flags, group=self.process_group, async_op=True)
            state, hook = self._comm_hook
            bucket.work = _HookWork(hook(state, _BucketView(self, b, gradients)), bucket.gradients, flags)
        else:  # every slot already holds its gradient divided (`_pack`)
            bucket.work = all_reduce_in(bucket.buffer, self.comm_dtype, self.process_group)
        self.events.append(("launch", b, time.perf_counter()))
        self._next_launch = b + 1
    # --8<-- [end:grad_ready]

    # --8<-- [start:finish]
    @torch.no_grad()
    def _finish_backward(self) -> None:
        self.events.append(("backward_end", None, time.perf_counter()))
        if not self.buckets:  # only expert shards train: `_reduce_expert_shards` does it all
            return
        # Buckets not launched yet (overlap off, or still waiting for a gradient that never came:
        # a parameter unused in this backward): in with what .grad holds (accumulated earlier, or
        # zero) and launch.
        divisor = self._divisor()
        for b in range(self._next_launch, len(self.buckets)):
            self._pack(b, divisor)
            self._launch(b)
        self.buckets[-1].work.wait()
        used = (self._flags > 0).tolist()  # got a gradient on some rank (the flags' sum counts them)
        post = self._pre_post(self.world_size)[1]
        for bucket in self.buckets:
            bucket.work.wait()  # the average: each rank sent its gradients divided by N (prescaled)
            if post != 1 and self._comm_hook is None:  # prescale_gradients false: divide the sum now
                bucket.gradients.div_(post)
            for p, view, k in zip(bucket.params, bucket.views, bucket.flag_index):
                if not used[k]:
                    p.grad = None  # unused on every rank: no gradient, as in one process
                elif not self.gradient_as_bucket_view:
                    p.grad = view.clone()
                elif p.grad is not view:  # (already the view: a later backward accumulated into it)
                    p.grad = view
            bucket.ready.clear()
            bucket.work = None
        self._next_launch = 0
    # --8<-- [end:finish]


class _BucketView:
    """What a comm hook sees of bucket `b`: the methods of torch's `dist.GradBucket`."""

    def __init__(self, ddp: BucketedDDP, b: int, gradients: int):
        self._ddp, self._b, self._n = ddp, b, gradients

    def index(self) -> int:
        return self._b

    def is_last(self) -> bool:
        return self._b == len(self._ddp.buckets) - 1

    def buffer(self) -> torch.Tensor:
        return self._ddp.buckets[self._b].buffer[: self._n]  # (gradients,) without the usage flags

    def gradients(self) -> list[torch.Tensor]:
        bucket = self._ddp.buckets[self._b]
        return [bucket.slot(i) for i in range(len(bucket.params))]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._ddp.buckets[self._b].params)


class _HookWork:
    """A hook's future as a `Work`: waiting copies its value into the bucket."""

    def __init__(self, future, out: torch.Tensor, flags: comm.Work | None):
        self._future, self._out, self._flags = future, out, flags

    def wait(self) -> None:
        if self._flags is not None:
            self._flags.wait()
        value = self._future.wait()
        if value.data_ptr() != self._out.data_ptr():
            self._out.copy_(value)
