"""The engine's step with pipeline parallelism (`parallel.pipeline` = p > 1).

`PipelineStep` (built by `engine/parallelize.py`, first in its order) cuts the GPT into p x v
model stages (`tinyscale.pipeline.partition_gpt`, v = `parallel.virtual_stages`), keeps this
rank's (`tinyscale.pipeline.apply_pipeline`: the model keeps only its parameters, under their
original names) and lowers the schedule `parallel.pipeline_schedule` (afab, 1f1b,
interleaved_1f1b, zb_h1) for m = `gradient_accumulation_steps` micro-batches. The mesh is
(pp, dp, cp, tp): the ranks of one pipeline are dp x cp x tp apart, and every other axis
composes with it, each in its place in the engine's order:

- tp (`split_tensor_parallel`, `engine/pipeline_tp.py`): this rank's stages split over the TP
  group; each TP rank runs its own pipeline over its own pp group, the last stage's loss
  vocab-parallel. With sequence parallelism the stages pass (B, T/t, C) shards;
- cp (`split_context_parallel`, `engine/context.py`): each micro-batch's sequence shard goes
  in, every stage's attention is ring or Ulysses over the cp group, the loss is the full rows'
  mean with a backward of cp times its gradient (the dp x cp mean then sums over cp);
- dp: DDP, or ZeRO stage 1, 2 or 3 over dp (x cp). Stage 2 runs the schedule under `no_sync`
  and reduce-scatters every bucket once after it (torchtitan's FSDP with a pipeline): Psi
  on the wire per step, not per micro-batch. Stage 3 (`zero_stage3`,
  `tinyscale.zero.stage3_manual`) shards the parameters too, one unit per stage of this rank,
  all-gathered before the stage's compute actions (`_Stage3Driver`, the executor's hooks) and
  either kept while a micro-batch is in flight or freed after every pass
  (`parallel.pipeline_reshard_after_forward`); its gradients too are reduce-scattered once.

One step (`PipelineStep.train_step`), on every rank of every pipeline:

1. this dp rank's rows of the global batch, cut into m micro-batches (the engine's rule,
   `tinyscale.data.local_micro_batches`), with cp this rank's sequence shard of each, ids into
   the first stage, targets into the last;
2. the schedule's forwards, backwards and sends over the pp group (`PipelineExecutor`),
   each backward scaled by 1/m (and by the loss scale under fp16), gradients accumulating
   in ``.grad`` (in fp16/bf16 under mixed precision, activations sent in it too);
3. a tied embedding/head: the first and last stage add their gradients (`exchange_tied_grads`;
   with a compression hook after step 4, each stage's compressed mean: `engine/compression.py`);
4. the data-parallel reduction over dp (x cp), once, after the schedule: DDP's buckets
   all-reduced, or ZeRO 2's and 3's reduce-scattered; ZeRO stage 1 reduce-scatters in its step;
5. the loss: the last stage's mean over its m micro-batches, summed over the pp group (the
   others add zero: a broadcast from the last stage), then averaged over dp;
6. fp16: an inf/nan on any rank of the world skips the step on every rank (the flag is
   agreed over the world, not the dp group: the other stages hold the rest of the model);
7. clipping by the norm of the whole model's gradient, each element once, as the placements say
   (`engine/grad_norm.py`; under mixed precision on the fp32 masters' unscaled gradients):
   squares summed over the pp group and then the TP group, the tied table counted on the first
   stage only; ZeRO sums its gradient shards' counted fragments over the world. Then the
   learning rate and the step.

communication_data_type applies to step 4's reduction (DDP's buckets, ZeRO's reduce-scatters
sent in that dtype), as without a pipeline. wall_clock_breakdown (`engine.last_step["profile"]`)
times each F action as forward and each B, BW and W as backward (the executor's
`around_compute`), step 6 as the optimizer; the waits for a peer's activation or gradient (the
bubble) are comm_exposed, the host's work between actions other, and `pipeline_bubble` is
this rank's share of the schedule's time outside its compute actions (`PipelineStep.profile`).

A forward, backward or loss that raises on some stages: the executor runs the schedule's
messages to the end anyway (a failed stage sends messages saying so), every rank agrees on who
failed (one all-reduce of a flag per rank, `step_failure.failed_ranks`) and drops the step, as
the data-parallel engine does: that rank re-raises its error, the others raise `StepFailed`
naming it. With tp, a rank that stops computing posts so at once (the executor's
`on_failure`), its TP peers waiting in a collective give up, and the agreement runs over a
gloo group of its own (`step_failure.FailureWatch`); if a peer gave up, the engine stops. A failure in the messages themselves still stops the engine. Tests:
`pytest tests/engine/test_engine_pipeline.py` (keys engine_pipeline, pp_afab, pp_1f1b,
pp_interleaved, pp_zero_bubble), `pytest tests/engine/test_engine_pipeline_compose.py` (with
the other axes and ZeRO: keys engine_pipeline, layout_pp); fp16/bf16: `pytest -k layout_mixed_precision`;
`pytest tests/engine/test_engine_pipeline_profile.py` (the profile, communication_data_type).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from tinyscale.data import local_micro_batches
from tinyscale.dist import ParallelMesh, comm
from tinyscale.engine import compression, context, expert
from tinyscale.engine.plan import LayoutPlan
from tinyscale.models.dropout import set_dropout_clock
from tinyscale.models.gpt import GPT, check_ids
from tinyscale.optim import check_elementwise_state, set_lr
from tinyscale.pipeline import (
    add_communication, afab, interleaved_1f1b, one_f_one_b, partition_gpt, zb_h1,
)
from tinyscale.engine import pipeline_tp, step_failure
from tinyscale.engine.step_failure import StepFailed, failed_ranks
from tinyscale.pipeline.apply import apply_pipeline
from tinyscale.pipeline.executor import PipelineExecutor, exchange_tied_grads, gpt_loss
from tinyscale.context_parallel import shard_batch
from tinyscale.pipeline.schedules import BW, F, W
from tinyscale.zero import ZeroStage2
from tinyscale.zero.stage3_manual import ZeroStage3Manual

SCHEDULES = {  # parallel.pipeline_schedule -> (p, m, v) -> compute actions per rank
    "afab": lambda p, m, v: afab(p, m),
    "1f1b": lambda p, m, v: one_f_one_b(p, m),
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": lambda p, m, v: zb_h1(p, m),
}


class PipelineStep:
    """This rank's stages, its schedule's executor, and one training step over them."""

    def __init__(self, model: GPT, plan: LayoutPlan, mesh: ParallelMesh, micro_batches: int) -> None:
        p, v, m = plan.pp, plan.virtual_stages, micro_batches
        self.group, self.ranks, self.rank = mesh.group("pp"), mesh.group_ranks("pp"), mesh.rank("pp")
        self.shapes = {k: (t.shape, t.dtype) for k, t in model.state_dict().items()}  # the original keys
        self.order = {n: i for i, (n, _) in enumerate(model.named_parameters())}  # a tied table once
        self.gpt_config = model.config
        self.plan = partition_gpt(model.config, p, virtual_stages=v)
        self.stages = apply_pipeline(model, self.plan, self.rank)
        self.schedule = add_communication(SCHEDULES[plan.schedule](p, m, v))
        self.executor = PipelineExecutor(self.schedule, self.rank, self.stages, loss_fn=gpt_loss,
                                         ranks=self.ranks, group=self.group)
        self.tp_group = self.cp_group = self.stage3 = None
        self.schedule_seconds: float | None = None  # wall_clock_breakdown: executor.run's, last step
        self.sequence_parallel = False
        self._bind(model)

    def _bind(self, model: GPT) -> None:
        """The tied table's copy here, and the name its last-stage copy is saved under."""
        # A tied table lives on the first and last stage's ranks: their gradients are summed.
        first, last = self.plan[0], self.plan[-1]
        self.tied = None
        if model.config.tie_embeddings and self.rank in (first.rank, last.rank):
            mine, peer = (first, last) if self.rank == first.rank else (last, first)
            stage = self.stages[mine.stage]
            self.tied = (stage.embed.weight if mine is first else stage.head.weight, self.ranks[peer.rank])
        # The last stage's copy of a tied table is saved (and counted in the gradient norm,
        # engine/grad_norm.py) once, under the original model's name: the first stage's.
        copy = self.tied is not None and self.rank == last.rank
        self.aliases = {"head.weight": "embed.weight"} if copy else {}

    def split_tensor_parallel(self, model: GPT, mesh: ParallelMesh, *, sequence_parallel: bool = False) -> None:
        """Second in the engine's order: this rank's stages split over the tp axis
        (`engine/pipeline_tp.py`), the last stage's loss the vocab-parallel cross-entropy."""
        self.tp_group, self.sequence_parallel = mesh.group("tp"), sequence_parallel
        pipeline_tp.split_stages(model, self.stages, self.tp_group, sequence_parallel=sequence_parallel)
        self.executor.loss_fn = pipeline_tp.vocab_parallel_loss(self.tp_group, model.config.vocab_size)
        self._bind(model)  # the embedding and head are new Parameters

    def split_context_parallel(self, model: GPT, plan: LayoutPlan, mesh: ParallelMesh) -> None:
        """Third: this rank's stages run on their sequence shard, attention over the cp axis
        (`engine/context.py`); each micro-batch is sharded in `train_step`."""
        self.cp_group, self.cp_sharding = mesh.group("cp"), plan.context_sharding
        self.executor.loss_fn = context.apply_to_stages(self.stages, model, plan, mesh)

    def zero_stage3(self, groups, make, group, *, reshard_after_forward: bool, **kwargs) -> ZeroStage3Manual:
        """Last in the order, ZeRO stage 3 over dp (x cp): one unit per stage of this rank, gathered
        and freed around the schedule's compute actions (`_Stage3Driver`), reduce-scattered once."""
        order = sorted(self.stages)
        zero = ZeroStage3Manual(groups, make, group, modules=[self.stages[s] for s in order], **kwargs)
        driver = _Stage3Driver(zero, {s: u for u, s in enumerate(order)}, reshard_after_forward)
        self.executor.hooks = (driver.before, driver.after)
        self.stage3 = driver
        return zero

    def full_shapes(self) -> dict:
        return {k: shape for k, (shape, _) in self.shapes.items()}

    def train_step(self, engine, batch: tuple[torch.Tensor, ...]) -> tuple[float, bool]:
        """One optimizer step of `engine` over the global batch; returns (mean loss, skipped=False)."""
        if len(batch) != 2:
            raise ValueError(f"train_batch: with parallel.pipeline the batch is (ids, targets), got {len(batch)} "
                             "tensors")
        for ids, name in zip(batch, ("idx", "targets")):  # on every rank alike, before any message: a bad
            check_ids(ids, self.gpt_config, name)        # id seen by one stage would leave the others waiting
        engine.model.train()
        if engine.zero is not None:
            engine.zero.abandon_backward()  # nothing to forget unless a caller ran backward itself
        if self.stage3 is not None:
            self.stage3.begin()
        seq_len, tp = batch[0].shape[1], dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        if self.sequence_parallel and seq_len % tp:  # on every rank alike, before any message
            raise ValueError(f"train_batch: sequence parallel: sequence length T={seq_len} is not divisible by "
                             f"parallel.tensor={tp}; use a T that is a multiple of {tp}, or sequence_parallel false")
        micro = local_micro_batches(batch, dp_rank=engine.dp_rank, dp_size=engine.dp_size,
                                    micro_batch_size=engine.batch.micro_batch_size)
        if self.cp_group is not None:  # this cp rank's sequence shard of each (B, T) -> (B, Tl)
            micro = [shard_batch(tuple(chunk), self.cp_group, self.cp_sharding) for chunk in micro]
        inputs = [chunk[0].to(engine.device) for chunk in micro]  # (B, T) ids per micro-batch
        targets = [chunk[1].to(engine.device) for chunk in micro]
        self.executor.around_compute = functools.partial(_around_compute, engine, len(micro), len(micro[0][0]))
        profiler = engine.profiler  # wall_clock_breakdown: the schedule's time beside its phases
        # the engine's roll-back triple: torch's and CUDA's generators, no TP tracker (refused with a pipeline)
        rng = (torch.random.get_rng_state(), torch.cuda.get_rng_state() if engine.device.type == "cuda" else None, {})
        failed: list[int] = []
        # fp16: every backward is of loss x S (the loss reported stays unscaled)
        self.executor.loss_scale = 1.0 if engine.loss_scaler is None else engine.loss_scaler.scale
        # an MoE GPT: each layer backpropagates its aux loss as the executor does the loss (engine/expert.py)
        self.moe_aux = 0.0
        if self.gpt_config.moe_experts:
            expert.set_aux_grad_scale(engine.model, self.executor.loss_scale / len(micro))
        try:
            with comm.record(engine.comm_ledger):
                # --8<-- [start:step]
                # DDP and ZeRO 2 synchronise once, below: the schedule's backwards (and zero-bubble's
                # W passes, which run the hooks as a backward does) only accumulate.
                error, watch = None, engine._failure_watch  # watch: with tp, TP peers mid-compute
                with _no_sync(engine), watch.attempt_step() if watch else contextlib.nullcontext():
                    self.executor.on_failure = None if watch is None else watch.post
                    try:
                        start = _now(engine) if profiler.enabled else 0.0
                        loss = self.executor.run(inputs, targets)
                        self.schedule_seconds = _now(engine) - start if profiler.enabled else None
                    except Exception as exc:  # noqa: BLE001 - the schedule ran to its end: drop the step
                        if self.executor.failed is None:
                            raise  # the messages themselves failed
                        error = exc if self.executor.failed[1] is not None else None  # else a peer's
                if watch is None:
                    failed = failed_ranks(error is not None, engine.device)  # who, over the world
                else:  # over a group of its own: a TP group may be out of step
                    failed, abandoned = watch.agree(error)
                    if abandoned:
                        engine._roll_back(rng)
                        engine._broken = step_failure.broken_message(engine.step, failed, abandoned)
                        if error is not None and not isinstance(error, step_failure.PeerFailed):
                            raise error
                        raise StepFailed(engine._broken)
                if failed:
                    engine._roll_back(rng)
                    raise error if error is not None else StepFailed(
                        f"train_batch: step {engine.step} raised on pipeline rank(s) {failed} (see the error "
                        "there); every rank dropped the step, so the engine is as it was before it: retry "
                        "the batch or skip it")
                # A compressing hook: each stage compresses its own part of a tied table, and
                # the two stages add their compressed means after the sync (engine/compression.py).
                hooked = compression.snapshot(engine.ddp)
                if self.tied is not None and hooked is None:
                    exchange_tied_grads(*self.tied, group=self.group)
                # which parameters got a gradient here (W passes too), before ZeRO 2 frees them
                used = None if engine.zero is None else torch.tensor(
                    [q.grad is not None for q in engine.zero.sharded.params], dtype=torch.float64,
                    device=engine.device)
                if engine.ddp is not None:
                    engine.ddp.sync_gradients()
                if hooked is not None:
                    compression.keep_unsent(engine.ddp, hooked)
                    compression.after_sync(engine, self.tp_group)
                    if self.tied is not None:
                        exchange_tied_grads(*self.tied, group=self.group)
                if isinstance(engine.zero, ZeroStage2 | ZeroStage3Manual):  # one reduce-scatter per unit, now
                    engine.zero.reduce_gradients()
                total = torch.zeros((), dtype=torch.float64, device=engine.device)
                if loss is not None:
                    total += loss.detach().double()
                total += self.moe_aux / len(micro)  # this rank's stages' aux losses (an MoE GPT; else 0)
                comm.all_reduce(total, group=self.group)  # only the last stage's is not zero
                if engine.dp_size > 1:
                    comm.all_reduce(total, group=engine.dp_group)
                # --8<-- [end:step]
        except Exception as exc:
            if failed:  # dropped on every rank
                raise
            engine._broken = f"step {engine.step} raised inside the pipeline schedule ({type(exc).__name__}: {exc})"
            raise
        mean_loss = total.item() / engine.dp_size
        # The same value on every rank: all drop the step together. fp16: an overflow is the
        # scaler's business (every rank skips the step in the optimizer step), not divergence.
        if not math.isfinite(mean_loss) and engine.loss_scaler is None:
            engine._roll_back(rng)
            compression.restore(engine.ddp, hooked)  # the hooks ran in the sync
            raise FloatingPointError(f"train_batch: the loss at step {engine.step} is {mean_loss}; training "
                                     "diverged (the step was dropped on every rank)")
        engine._before_step_report = engine.memory_report()  # the step's peak of model states
        lr = engine.lr_at(engine.step - engine.skipped_steps) if engine._schedules_lr else None
        try:
            with comm.record(engine.comm_ledger), profiler.phase("optimizer"):
                skipped = self._optimizer_step(engine, lr, used)
        except Exception as exc:
            engine._broken = f"step {engine.step} raised in the optimizer step ({type(exc).__name__}: {exc})"
            raise
        engine.skipped_steps += int(skipped)
        engine.step += 1
        return mean_loss, skipped

    def profile(self, breakdown: dict[str, float]) -> dict[str, float]:
        """wall_clock_breakdown's pipeline keys beside `breakdown` (the step's, as_dict): the
        schedule's seconds on this rank and its bubble, the share of them this rank spent
        outside its F, B, BW and W actions (waiting for a peer's message, posting its own, the
        warm-up and cool-down), comparable with `simulate(schedule).bubble_fraction`."""
        compute = breakdown["forward"] + breakdown["backward"]  # every F/B/W phase lies inside the schedule
        return {"pipeline_schedule": self.schedule_seconds,
                "pipeline_bubble": 1.0 - compute / self.schedule_seconds}

    def _optimizer_step(self, engine, lr: float | None, used: torch.Tensor | None) -> bool:
        """Clip, step; True if fp16 overflow skipped the step (on every rank of the world)."""
        if engine.zero is not None:  # stage 1: reduce-scatter over dp (x cp); stage 2 did; step the shard, all-gather
            if engine.reduce_size > 1:
                comm.all_reduce(used, group=engine.reduce_group)  # got a gradient on some dp (x cp) rank
            if lr is not None:
                engine.zero.set_lr(lr)
            # clipping: ZeRO's clipper sums each counted fragment's squares over the world (engine/grad_norm.py)
            skipped = engine.zero.step(max_norm=engine.config.gradient_clipping, used=used.cpu() > 0)
            if engine.step == engine.skipped_steps:  # the first step taken: the states now exist
                check_elementwise_state(engine.optimizer)
            return skipped
        if engine.compute_dtype is not None:  # fp32 masters: overflow check, unscale, clip, step, round
            if lr is not None:
                set_lr(engine.optimizer, lr)
            skipped = engine.optimizer.step(max_norm=engine.config.gradient_clipping)  # the layout's norm
            engine.optimizer.zero_grad(set_to_none=True)
            return skipped
        if engine.config.gradient_clipping > 0:  # the whole model's norm (engine/grad_norm.py)
            engine.last_grad_norm = engine.grad_norm().clip_(engine.config.gradient_clipping,
                                                             [(q, q.grad) for q in engine.params])
        if lr is not None:
            set_lr(engine.optimizer, lr)
        engine.optimizer.step()
        engine.optimizer.zero_grad(set_to_none=True)
        return False


# --8<-- [start:stage3-driver]
class _Stage3Driver:
    """ZeRO 3 under the schedule: a stage's unit is gathered (all-gather over dp) before each of
    its compute actions. `reshard_after_forward`: freed after every action, so gathered again for
    each micro-batch's forward, backward and zero-bubble's W; else kept while any of its
    micro-batches is between its forward and the end of its backward (BW, or W after B)."""

    def __init__(self, zero: ZeroStage3Manual, unit: dict[int, int], reshard_after_forward: bool) -> None:
        self.zero, self.unit, self.reshard = zero, unit, reshard_after_forward
        self.begin()

    def begin(self) -> None:
        self.in_flight = dict.fromkeys(self.unit.values(), 0)

    def before(self, a) -> None:
        u = self.unit[a.stage]
        self.zero.gather(u)
        if a.kind == F:
            self.in_flight[u] += 1

    def after(self, a) -> None:
        u = self.unit[a.stage]
        if a.kind in (BW, W):  # this micro-batch's backward is complete
            self.in_flight[u] -= 1
        if self.reshard or self.in_flight[u] == 0:
            self.zero.release(u)
# --8<-- [end:stage3-driver]


def _now(engine) -> float:
    """The profiler's clock: CUDA kernels are asynchronous, so wait for them first."""
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter()


@contextlib.contextmanager
def _around_compute(engine, micro_batches: int, rows: int, a) -> Iterator[None]:
    """Around one compute action of the schedule: counter dropout learns the micro-batch's first
    row in the global batch (before each of its passes, so a recomputation reads the same), and
    wall_clock_breakdown times an F action as forward, B, BW and W as backward."""
    set_dropout_clock(engine.model, step=engine.step, row0=(engine.dp_rank * micro_batches + a.microbatch) * rows)
    profiler = engine.profiler
    moe = a.kind == F and engine.pipeline.gpt_config.moe_experts > 0
    if moe:
        expert.take_aux(engine.model)  # a recomputation's, in an earlier backward: not this forward's
    with profiler.phase("forward" if a.kind == F else "backward") if profiler.enabled else contextlib.nullcontext():
        yield
    if moe:  # an MoE GPT's aux losses join the reported loss (their gradient is AddAuxLoss's)
        engine.pipeline.moe_aux += expert.take_aux(engine.model)


def _no_sync(engine):
    """The schedule's backwards only accumulate: DDP's buckets and ZeRO 2's wait for the end."""
    if engine.ddp is not None:
        return engine.ddp.no_sync()
    return engine.zero.no_sync() if isinstance(engine.zero, ZeroStage2) else contextlib.nullcontext()


