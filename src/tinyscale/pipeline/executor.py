"""One executor for every pipeline schedule: run a rank's lowered action list on its stages.

The schedule (`schedules.py`, lowered by `add_communication`) decides the order; this file
only knows what each action means:

- F: run the stage on its input (micro-batch ids on stage 0, a received activation
  elsewhere); the last stage applies `loss_fn`, keeps loss / m, and starts its backward from 1 / m.
- BW: backward of the stage's output (or scaled loss) into its input and its parameters.
- B and W (zero-bubble's split, `split_backward.py`): B computes the input gradient (what the
  previous stage waits for) and keeps the gradients that reach the nodes holding a parameter's
  edge; W starts there later and runs only those nodes' weight side (a matmul's weight-gradient
  matmul), nothing B ran above them: W is the weight matmuls, B the rest (ZB paper, sec. 2).
  On stage 0, which sends no input gradient, B does nothing and W is the whole backward.
  Each W runs the parameters' post-accumulate-grad hooks once, as one backward (DDP's and
  ZeRO's hooks reduce there as after a BW), and B none: B writes no parameter's gradient.
- SEND/RECV: a run of consecutive sends goes out as one batched isend, a lone send as an
  isend, as torch's pipelining does (`tinyscale.dist.comm`, so the ledger counts it).
  Each message is a *frame*: the tensor's elements and one status element after them (0 ok,
  1 reshaped, 2 failed), built by one `torch.cat`; a receive is a view of its frame. Shapes
  travel only when they are new: the first time a (direction, stage, micro-batch) is sent,
  a header (dtype, number of dims, shape; 8 int64) goes first and both ends remember the
  shape; afterwards the frame alone goes, sized from memory, as torch's pipelining sends
  tensors of shapes fixed in advance. A tensor whose shape changed
  (another sequence length next step) goes as a frame of the remembered size with status 1,
  then the header and the new frame. Receives wait in schedule order. A receive is posted
  where the schedule takes it, after its run's sends, as torch's pipelining does, except on
  gloo when the rank sends its peer nothing between the previous receive from that peer and
  this one (AFAB's runs of forwards and of backwards), and the simulator (unit costs) has its
  send issued by the time the rank reaches it: then it is posted as soon as that previous one
  has arrived, so the bytes land while the rank computes. (Where the rank would wait for the
  send anyway, as at 1F1B's last receive, the ready notice travels while it waits.) Measured both ways on
  gloo (lessons/08): a receive posted early while the rank then sends to the same peer (1F1B)
  made each rank's gloo thread spend 4.5 to 7 ms more CPU per step (m = 8), taken from the
  compute on shared cores; with no send in between (AFAB) posting early took CPU off that
  thread and the step. (NCCL would serialise a posted receive ahead of the sends on the same
  pair, so there every receive is posted where the schedule takes it.) Also on gloo, a run
  that receives then waits for the rank's sends posted so far, as torch's Schedule1F1B waits
  each fused send and receive, where `_can_wait_sends` finds that no rank can block so (not
  interleaved 1F1B); elsewhere sends are waited for at the end of the pass.
- a compute action that raises: the rank runs the rest of its schedule's messages, each
  saying which rank failed (no data: a frame of the remembered size with status 2 and a
  header naming the rank, or that header alone), and so does every rank that receives one;
  `run` then re-raises the error (or `StageFailed` naming the rank), none left waiting.

Gradients accumulate in `.grad` over the m micro-batches, each backward scaled by 1/m (and
by `loss_scale` S under fp16: the caller unscales), so after `run` they are the gradient of
the mean loss over the batch, as in one process; the
optimizer step (and any data-parallel reduction) is the caller's. Messages between two ranks
are matched in the order posted (NCCL has no tags): the simulator checks that a schedule
receives in the order it sends.

Shape legend: B rows of a micro-batch, T sequence length, C d_model, V vocab size.
Test: `pytest tests/pipeline -k pp_executor` (2 ranks, float64, against tinyscale.reference).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F_
from torch import nn

from tinyscale.dist import comm
from tinyscale.models.gpt import GPT
from tinyscale.pipeline.partition import StageLayers
from tinyscale.pipeline.schedules import (
    B, BW, COMM_KINDS, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, Schedule, stage_ranks,
)
from tinyscale.pipeline.simulator import matching_send, simulate
from tinyscale.pipeline.split_backward import Kept, backward_input, backward_weight

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]  # header code -> dtype
_HEADER = 8  # int64 slots: dtype code, number of dims, up to 6 sizes
_FAILED = -1  # header code: the sender's stage (or one before it) raised this step; [1] = who
_OK, _RESHAPED, _FAILED_FRAME = 0, 1, 2  # a frame's status element (exact in every dtype)


class StageFailed(RuntimeError):
    """Another pipeline stage raised during this pass over the schedule (`rank`: its global rank)."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"pipeline rank {rank} raised during the schedule")
        self.rank = rank


class GPTStage(nn.Module):
    """One model stage of a GPT, sharing the original model's modules (no copies):
    [embedding] -> blocks[spec.layers] -> [final norm -> head]. Input (B, T) ids on the first
    stage, (B, T, C) activations elsewhere; output (B, T, C), or (B, T, V) logits on the last."""

    def __init__(self, model: GPT, spec: StageLayers) -> None:
        super().__init__()
        self.spec = spec
        self.embed = model.embed if spec.embedding else None
        self.blocks = nn.ModuleList(model.blocks[i] for i in spec.layers)
        self.norm = model.norm if spec.head else None
        self.head = model.head if spec.head else None
        self._rope = (model.rope_cos, model.rope_sin)  # (max_seq_len, D) each, not parameters
        # Set by the layouts that cut the sequence (the engine's): with sequence parallelism over
        # t ranks the activations between stages are (B, T/t, C) shards (`sequence_shards` = t);
        # with context parallelism `positions(Tl)` gives the global positions of this rank's Tl tokens.
        self.sequence_shards = 1
        self.positions: Callable[[int], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1] if self.embed is not None else x.shape[1] * self.sequence_shards  # ids (B, T) or (B, T/t, C)
        if self.embed is not None:
            x = self.embed(x)  # (B, T) -> (B, T, C), or (B, T/t, C) under sequence parallelism
        if self.positions is None:
            cos, sin = self._rope[0][:T], self._rope[1][:T]  # (T, D)
        else:
            where = self.positions(T).to(self._rope[0].device)  # (Tl,)
            cos, sin = self._rope[0][where], self._rope[1][where]  # (Tl, D) at the global positions
            clock = getattr(self.blocks[0], "dropout_clock", None) if len(self.blocks) else None
            if clock is not None:  # counter dropout: the residual masks' token positions (one clock per GPT)
                clock.positions = where
        for block in self.blocks:
            x = block(x, cos, sin)  # (B, T, C)
        if self.head is not None:
            x = self.head(self.norm(x))  # (B, T, C) @ (C, V) -> (B, T, V)
        return x


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's own loss on its logits: mean cross-entropy over all B*T positions."""
    V = logits.shape[-1]
    logits = logits.reshape(-1, V).to(torch.promote_types(logits.dtype, torch.float32))  # (B*T, V)
    return F_.cross_entropy(logits, targets.reshape(-1).long())


class PipelineExecutor:
    """Runs pipeline rank `rank`'s actions of a lowered `schedule` on its `stages` (model
    stage index -> module). `ranks[r]` is the global rank of pipeline rank r (default r)."""

    def __init__(self, schedule: Schedule, rank: int, stages: dict[int, nn.Module], *,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 ranks: Sequence[int] | None = None, group=None) -> None:
        plan = simulate(schedule)  # refuse a broken or deadlocking schedule before any message is sent
        self.where = stage_ranks(schedule)
        if set(stages) != {s for s, r in self.where.items() if r == rank}:
            raise ValueError(f"rank {rank} was given stages {sorted(stages)} but the schedule runs "
                             f"{sorted(s for s, r in self.where.items() if r == rank)} there")
        self.actions, self.stages, self.loss_fn, self.group = schedule[rank], stages, loss_fn, group
        self.num_stages = max(self.where) + 1
        self.num_microbatches = len({a.microbatch for a in self.actions})
        self.ranks = list(ranks) if ranks is not None else list(range(len(schedule)))
        self.me = self.ranks[rank]
        # each send / receive -> (its peer's global rank, `_key`): looked up, not derived, per message
        self.route = {a: (self._peer(a), _key(a)) for a in self.actions if a.kind in COMM_KINDS}
        # (direction, receiving stage, micro-batch) -> (shape, dtype) last sent / received there
        self.sent_shapes: dict[tuple, tuple] = {}
        self.recv_shapes: dict[tuple, tuple] = {}
        # On gloo: a receive -> the next receive from the same peer, posted as soon as the first
        # has arrived, where the rank sends that peer nothing in between (see the docstring).
        # Only where the simulator (unit costs) has the data sent by the time the rank reaches the
        # receive: where the rank waits for the send anyway, the ready notice travels meanwhile.
        self.early: dict[Action, Action] = {}
        if group_backend(group) == "gloo":
            slack = _receive_slack(plan, rank)
            last: dict[int, Action | None] = {}  # peer -> its latest receive, None after a send to it
            for a in self.actions:
                if a.kind in (SEND_F, SEND_B):
                    last[self._peer(a)] = None
                elif a.kind in (RECV_F, RECV_B):
                    if last.get(self._peer(a)) is not None and slack[a] <= 0:
                        self.early[last[self._peer(a)]] = a
                    last[self._peer(a)] = a
        # On gloo, as torch's Schedule1F1B: a run that receives waits, after its receives, for
        # the sends posted so far, when the schedule cannot deadlock so (`_can_wait_sends`).
        self.wait_sends = group_backend(group) == "gloo" and _can_wait_sends(schedule)
        self.loss_scale = 1.0  # fp16's loss scale S, set by the caller before each run
        self._seeds: dict = {}  # `_seed`'s S / m, kept while (shape, dtype, device, S) stay
        # (before, after): called with every compute action, also on a rank whose compute raised
        # (a caller's collectives, e.g. ZeRO 3's all-gathers over dp, stay matched across ranks)
        self.hooks: tuple[Callable[[Action], None], Callable[[Action], None]] | None = None
        # A context manager around each compute action itself (inside `hooks`, so ZeRO 3's
        # gathers stay outside it; not entered on a rank whose compute raised): the engine tells
        # the model which global rows come (counter dropout, recomputation included) and, with
        # wall_clock_breakdown, times F as forward and B, BW and W as backward there.
        self.around_compute: Callable[[Action], contextlib.AbstractContextManager] | None = None
        # Called once when this rank stops computing (its compute raised, or a header said a
        # peer's did): its TP peers, mid-compute, must not wait for it (engine/step_failure.py).
        self.on_failure: Callable[[], None] | None = None

    def run(self, inputs: Sequence[torch.Tensor] | None, targets: Sequence[torch.Tensor] | None):
        """One pass over the schedule. `inputs` (micro-batch ids) matter on the rank holding
        stage 0, `targets` on the rank holding the last; returns the mean loss there, else None."""
        self.inbox: dict[tuple[str, int, int], torch.Tensor] = {}  # received activations / grads
        self.saved: dict[tuple[int, int], tuple] = {}  # (stage, mb) -> (input, output, grad_output)
        self.sends: list[comm.Work] = []
        self.sent_tensors: list[torch.Tensor] = []
        self.inputs, self.targets, self.losses = inputs, targets, []
        # A compute action that raises does not stop the schedule: this rank goes on with its
        # messages only, each a header saying so (no data), so no peer waits for it; a peer that
        # receives one does the same. `failed`: (global rank that raised first here, its error).
        self.failed: tuple[int, BaseException | None] | None = None
        self.posted: dict[Action, tuple[torch.Tensor, comm.Work]] = {}  # receives posted early
        self._run_device: torch.device | None = None  # `_device`, found at its first use in this run
        pending: list[Action] = []
        for a in self.actions:
            if a.kind in COMM_KINDS:
                pending.append(a)
                continue
            self._communicate(pending)
            pending = []
            if self.hooks is not None:
                self.hooks[0](a)
            if self.failed is None:
                try:
                    with self.around_compute(a) if self.around_compute is not None else contextlib.nullcontext():
                        {F: self._forward, BW: self._backward, B: self._backward, W: self._weight_grad}[a.kind](a)
                except Exception as exc:  # noqa: BLE001 - re-raised below, after the schedule's messages
                    self.failed = (self.me, exc)
                    if self.on_failure is not None:
                        self.on_failure()
            if self.hooks is not None:
                self.hooks[1](a)
        self._communicate(pending)
        for work in self.sends:
            work.wait()
        self.sent_tensors = []
        self.inbox, self.saved, self.losses = {}, {}, self.losses if self.failed is None else []
        self.inputs = self.targets = None  # views of the caller's batch: not kept past the step
        if self.failed is not None:
            rank, error = self.failed
            raise error if error is not None else StageFailed(rank)
        if not self.losses:
            return None
        return torch.stack(self.losses).sum()  # sum of loss_i / m: the mean loss

    # --8<-- [start:compute]
    def _forward(self, a: Action) -> None:
        s, i = a.stage, a.microbatch
        if s == 0:
            x = self.inputs[i]
        else:
            x = self.inbox.pop((F, s, i)).requires_grad_()  # a leaf: its .grad is what B sends back
        out = self.stages[s](x)
        if s == self.num_stages - 1:  # the loss; its backward starts from S / m (`_seed`)
            out = self.loss_fn(out, self.targets[i])
            self.losses.append(out.detach() / self.num_microbatches)  # the true loss / m
        elif self.where[s + 1] == self.where[s]:  # the next stage is on this rank: no message
            self.inbox[(F, s + 1, i)] = out.detach()
        self.saved[(s, i)] = (x, out)

    def _backward(self, a: Action) -> None:
        """BW: input and parameter gradients; B: the input gradient only (W comes later)."""
        s, i = a.stage, a.microbatch
        x, out = self.saved[(s, i)]
        grad_out = self._seed(out) if s == self.num_stages - 1 else self.inbox.pop((B, s, i))
        if a.kind == BW:
            self.saved.pop((s, i))
            torch.autograd.backward(out, grad_out)
            grad_in = x.grad if s > 0 else None
        elif s == 0:  # no input gradient: W does the whole backward
            self.saved[(s, i)] = (out, grad_out)
            grad_in = None
        else:  # W starts where B left the gradients at the parameters' nodes
            grad_in, self.saved[(s, i)] = backward_input(out, grad_out, x, self._trained(s))
        if grad_in is not None and self.where[s - 1] == self.where[s]:
            self.inbox[(B, s - 1, i)] = grad_in
        elif grad_in is not None:
            self.inbox[("out", s, i)] = grad_in  # picked up by SEND_B

    def _weight_grad(self, a: Action) -> None:
        kept = self.saved.pop((a.stage, a.microbatch))
        if isinstance(kept, Kept):
            backward_weight(kept)
        else:  # stage 0: (out, grad_out), B did nothing; AccumulateGrad runs the parameters' hooks
            (out, grad_out), params = kept, self._trained(a.stage)
            torch.autograd.backward(out, grad_out, inputs=params)

    def _seed(self, loss: torch.Tensor) -> torch.Tensor:
        """The last stage's output gradient, S / m (1 / m without fp16's loss scale S), so the m
        backwards sum to the gradient of the mean loss (times S). The same two ops autograd
        would run if the loss were divided by m (and multiplied by S) in the forward, on a seed
        of ones: the same bits, without an autograd node per micro-batch."""
        key = (loss.shape, loss.dtype, loss.device, self.loss_scale)
        if self._seeds.get("key") != key:
            seed = torch.ones_like(loss)
            if self.loss_scale != 1.0:
                seed = seed * self.loss_scale
            self._seeds = {"key": key, "seed": seed / self.num_microbatches}
        return self._seeds["seed"]

    def _trained(self, s: int) -> list[nn.Parameter]:
        return [p for p in self.stages[s].parameters() if p.requires_grad]
    # --8<-- [end:compute]

    def _outgoing(self, a: Action) -> torch.Tensor:
        """The tensor a send carries."""
        s, i = a.stage, a.microbatch
        if a.kind == SEND_F:
            return self.saved[(s, i)][1].detach()
        return self.inbox.pop(("out", s, i))

    # --8<-- [start:communicate]
    def _communicate(self, actions: list[Action]) -> None:
        """Post a run's sends together, then take its receives in order, then (`wait_sends`)
        wait for the sends. The simulator assumes sends never wait, so waiting only where
        `_can_wait_sends` allows keeps every schedule it accepts free of deadlock here."""
        ops, receives = [], []
        for a in actions:
            if a.kind in (SEND_F, SEND_B):
                ops += self._send_ops(a)
            else:
                receives.append(a)
        if len(ops) == 1:  # one send: no batch (as torch's pipelining posts a lone send)
            self.sends.append(comm.isend(ops[0].tensor, ops[0].peer, self.group))
        elif ops:
            self.sends += comm.batch_isend_irecv(ops)
        self.sent_tensors += [op.tensor for op in ops]  # alive until the sends complete
        for a in receives:
            self._receive(a)
        if receives and self.wait_sends:
            for work in self.sends:
                work.wait()
            self.sends = []

    def _send_ops(self, a: Action) -> list[comm.P2POp]:
        """A frame (after a header when the shape is new), or the failure messages."""
        peer, key = self.route[a]
        known = self.sent_shapes.get(key)
        send = lambda t: comm.P2POp("isend", t, peer, self.group)  # noqa: E731
        if self.failed is not None:  # no data: status 2 (if a frame is expected), then who failed
            failure = torch.zeros(_HEADER, dtype=torch.int64, device=self._device)
            failure[0], failure[1] = _FAILED, self.failed[0]
            return [send(failure)] if known is None else [send(_frame(None, known, _FAILED_FRAME, self._device)),
                                                          send(failure)]
        tensor = self._outgoing(a)
        shape = (tensor.shape, tensor.dtype)
        frame = send(_frame(tensor, shape, _OK, self._device))
        if known == shape:
            return [frame]
        self.sent_shapes[key] = shape
        header = send(_header(tensor, self._device))
        if known is None:
            return [header, frame]
        return [send(_frame(None, known, _RESHAPED, self._device)), header, frame]

    def _post(self, a: Action) -> tuple[torch.Tensor, comm.Work] | None:
        """Post the receive of `a`'s frame, if its shape is known (else its header must come first)."""
        peer, key = self.route[a]
        known = self.recv_shapes.get(key)
        if known is None:
            return None
        frame = torch.empty(known[0].numel() + 1, dtype=known[1], device=self._device)
        return frame, comm.irecv(frame, peer, self.group)

    def _post_early(self, a: Action) -> None:
        """`a` has arrived: post the next receive from its peer now if `early` says so."""
        after = self.early.get(a)
        posted = self._post(after) if after is not None else None
        if posted is not None:
            self.posted[after] = posted

    def _receive(self, a: Action) -> None:
        peer, key = self.route[a]
        posted = (self.posted.pop(a, None) if self.posted else None) or self._post(a)
        status = None
        if posted is not None:
            frame, work = posted
            work.wait()
            status = frame[-1].item()
        if status != _OK:  # a header comes: a new shape, a changed one, or a failure
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self._device)
            comm.irecv(header, peer, self.group).wait()
            if header[0].item() == _FAILED:  # no data follows
                if self.failed is None and self.on_failure is not None:
                    self.on_failure()
                self.failed = self.failed or (int(header[1].item()), None)
                if self.early:
                    self._post_early(a)
                return
            shape = _shape_from_header(header)
            frame = torch.empty(shape[0].numel() + 1, dtype=shape[1], device=self._device)
            comm.irecv(frame, peer, self.group).wait()
            self.recv_shapes[key] = shape
        if self.early:
            self._post_early(a)
        self.inbox[(F if a.kind == RECV_F else B, a.stage, a.microbatch)] = frame[:-1].view(self.recv_shapes[key][0])

    def _peer(self, a: Action) -> int:
        """The global rank a send goes to or a receive comes from."""
        stage = a.stage + 1 if a.kind in (SEND_F, RECV_B) else a.stage - 1
        return self.ranks[self.where[stage]]
    # --8<-- [end:communicate]

    @property
    def _device(self) -> torch.device:
        """The stages' device, looked up once per `run` (a walk over the modules per message showed)."""
        if self._run_device is None:
            self._run_device = next(p for m in self.stages.values() for p in m.parameters()).device
        return self._run_device


def _receive_slack(plan, rank: int) -> dict[Action, float]:
    """Each receive of `rank` -> when its matching send is issued less when the rank reaches the
    receive (the end of its previous action), in the simulation `plan`: > 0, the rank waits."""
    issued = {t.action: t.start for line in plan.timelines for t in line if t.action.kind in (SEND_F, SEND_B)}
    slack, reached = {}, 0
    for t in plan.timelines[rank]:
        a = t.action
        if a.kind in (RECV_F, RECV_B):
            slack[a] = issued[matching_send(a)] - reached
        reached = t.end
    return slack


def _can_wait_sends(schedule: Schedule) -> bool:
    """Whether every rank can wait, after each run's receives, for all its sends posted so far
    without deadlock: a send completes once its receive is posted (gloo's rendezvous), a
    receive once its send is posted. Stepped to a fixed point over the ranks' runs."""
    programs = []
    for actions in schedule:
        steps, run, outstanding = [], [], []
        for a in [*actions, None]:
            if a is not None and a.kind in COMM_KINDS:
                run.append(a)
                continue
            sends = [b for b in run if b.kind in (SEND_F, SEND_B)]
            receives = [b for b in run if b.kind in (RECV_F, RECV_B)]
            outstanding += sends
            steps += [("send", b) for b in sends] + [("receive", b) for b in receives]
            if receives and outstanding:
                steps.append(("wait", tuple(outstanding)))
                outstanding = []
            run = []
        programs.append(steps)
    sent, reached, at = set(), set(), [0] * len(programs)
    moved = True
    while moved:
        moved = False
        for r, steps in enumerate(programs):
            while at[r] < len(steps):
                what, x = steps[at[r]]
                if what == "send":
                    sent.add(_key(x))
                elif what == "receive":
                    reached.add(_key(x))
                    if _key(x) not in sent:
                        break
                elif not all(_key(b) in reached for b in x):
                    break
                at[r] += 1
                moved = True
    return all(i == len(steps) for i, steps in zip(at, programs))


def _header(t: torch.Tensor, device) -> torch.Tensor:
    if t.dim() > _HEADER - 2:
        raise ValueError(f"cannot send a {t.dim()}-D tensor between stages: at most {_HEADER - 2} dims")
    return torch.tensor([_DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (_HEADER - 2 - t.dim()),
                        dtype=torch.int64, device=device)


def _shape_from_header(h: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    code, ndim, *sizes = h.tolist()
    return torch.Size(sizes[:ndim]), _DTYPES[code]


def _key(a: Action) -> tuple[str, int, int]:
    """The same for a send and its receive: (direction, receiving stage, micro-batch)."""
    if a.kind in (SEND_F, SEND_B):
        return ("F", a.stage + 1, a.microbatch) if a.kind == SEND_F else ("B", a.stage - 1, a.microbatch)
    return ("F" if a.kind == RECV_F else "B", a.stage, a.microbatch)


def _frame(t: torch.Tensor | None, shape: tuple, status: int, device) -> torch.Tensor:
    """(numel + 1,): `t`'s elements (uninitialised when t is None) and the status element."""
    size, dtype = shape
    n = torch.Size(size).numel()
    if t is not None:  # one op: the hot path of every send (measured in lessons/08)
        return torch.cat((t.reshape(-1), _status_element(status, dtype, device)))
    frame = torch.empty(n + 1, dtype=dtype, device=device)
    frame[n] = status
    return frame


_STATUS: dict[tuple, torch.Tensor] = {}


def _status_element(status: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A (1,) tensor holding `status`, made once per (status, dtype, device) and only read."""
    key = (status, dtype, torch.device(device))
    if key not in _STATUS:
        _STATUS[key] = torch.full((1,), status, dtype=dtype, device=device)
    return _STATUS[key]


def group_backend(group) -> str:
    return dist.get_backend(group) if dist.is_initialized() else "gloo"


# --8<-- [start:tied]
def exchange_tied_grads(param: nn.Parameter, peer: int, group=None) -> None:
    """A weight used on two ranks (a tied embedding on the first stage and head on the last)
    gets the sum of both ranks' gradients on both, as Megatron does, so both copies step alike."""
    grad = param.grad if param.grad is not None else torch.zeros_like(param)
    theirs = torch.empty_like(grad)
    works = comm.batch_isend_irecv([comm.P2POp("isend", grad.contiguous(), peer, group),
                                    comm.P2POp("irecv", theirs, peer, group)])
    for work in works:
        work.wait()
    # Fixed order (lower rank's addend first) so both ranks compute bit-identical sums.
    first, second = (grad, theirs) if dist.get_rank() < peer else (theirs, grad)
    if param.grad is None:
        param.grad = first + second
    else:  # in place: under ZeRO 3 the parameter itself may be freed (no shape to check against)
        param.grad.copy_(first + second)
# --8<-- [end:tied]
