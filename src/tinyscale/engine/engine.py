"""`Engine`: one optimizer step over a global batch, whatever the layout underneath.

    engine = ts.initialize(model, config)   # inside ts.dist.launch / torchrun, or a plain process
    loss = engine.train_batch(batch)        # the global batch's mean loss, same on every rank

Set-up, in this order (each step needs the one before; `engine/parallelize.py` states it):
tensor parallelism splits the GPT over the mesh's tp axis (`parallel.tensor`; another model's
layers, found by name: AutoTP, `tinyscale.tensor_parallel.auto`), the
activation-checkpointing policy rebuilds its blocks (`tinyscale.checkpointing.apply_policy`);
the optimizer takes fp32 masters from the parameters before mixed precision rounds them to fp16/bf16
(`tinyscale.precision`); then the data-parallel wrapper or ZeRO stage hooks into the model.

What a step does over `dp` data-parallel ranks:

1. take this rank's rows of the global batch and cut them into micro-batches
   (`tinyscale.data.local_micro_batches`: contiguous blocks per rank, contiguous
   micro-batches within a block);
2. backward ``loss_i / gradient_accumulation_steps`` (times the loss scale under fp16)
   for each micro-batch, so the local gradient is that of the mean over this rank's rows;
3. average the gradients over the dp ranks, by ``zero_optimization.stage``:
   0: `tinyscale.data_parallel.BucketedDDP` all-reduces buckets of
   ``reduce_bucket_size`` elements, the first closing at 1 MiB (torch DDP's layout; not
   without ``overlap_comm``), during the last micro-batch's backward (the others run
   under `no_sync()`); 1: `tinyscale.zero.ZeroStage1` reduce-scatters buckets the same way,
   during the last backward only (as DeepSpeed's stage 1); 2: `tinyscale.zero.ZeroStage2` reduce-scatters buckets during every
   backward; 3: `tinyscale.zero.ZeroStage3` holds only parameter shards, its hooks on the
   model all-gather each unit (a block) for its forward and again for its backward, and
   reduce-scatter the unit's gradients as soon as backward is done with it. The mean over
   ranks is the mean over the global batch because every rank holds the same number of rows;
4. fp16: if any rank of the world saw an inf/nan gradient (any rank of any axis: a tp or
   pp peer holds the rest of the model), every rank skips the step and the loss scale
   backs off (the schedule does not advance); otherwise unscale. Clip by global norm (under
   mixed precision on the fp32 masters, by the whole model's norm in every layout), set
   this step's learning rate, step (ZeRO: on this rank's shard, then stages 1 and 2
   all-gather the parameters; stage 3 keeps them sharded), zero gradients.

Parameters no rank used in the step get no gradient and are not stepped (their usage flags
ride in the loss all-reduce, or in DDP's last bucket). If a forward or backward raises on any
rank, that rank makes the collectives the others make in the rest of the step, the loss
all-reduce tells every rank, and all drop the step (gradients, usage, random draws): the
rank that raised re-raises, the others raise `StepFailed`, and the engine is as before the
step (tests: `pytest -k failed_step`). Under tensor or context parallelism a rank raising
mid-forward leaves its peers inside the model's collectives: they give up on it (they poll a
flag it posts in the store) and every rank agrees over a gloo group of its own; if any rank
gave up a collective, the model's groups are out of step and the engine stops on every rank,
naming the rank that raised (engine/step_failure.py; `pytest -k failure_agreement`). An error
inside the optimizer step leaves the engine refusing further steps, since parameters may be
partly updated.

Every rank ends the step with identical parameters (stage 3: identical shards of them;
tensor parallel: the ranks of a dp group hold the same TP shard), which is what
`full_state_dict` returns (each rank's pieces placed by the placements: `engine/dcp_checkpoint.py`).
With `parallel.tensor` = t the "dp ranks" above are world / t: every rank of a TP group
gets the same rows, and all reductions above run over the dp axis only. With
`parallel.context` = c every rank of a cp group gets the same rows too, cuts its sequence
shard of each micro-batch, and the reductions run over dp x cp with the loss scaled by c, so
they sum over cp and average over dp (`engine/context.py`). With `parallel.pipeline` = p
the model keeps this rank's stages only and a step runs the pipeline schedule over the
micro-batches instead of the loop above, then DDP or ZeRO over dp (x cp), once; stage 3's
units are then this rank's stages, gathered around the schedule's actions
(`engine/pipeline_step.py`). fp16 and bf16 work in every one of these layouts
(`pytest -k layout_mixed_precision`).

A script's own forward/backward/step loop (`tinyscale.deepspeed`, DeepSpeed's API) runs the
micro-batches itself and ends each step in the same `_agree_step` and `_finish_step`. After every step the
monitor (`engine/monitor.py`: tensorboard, csv_monitor, per-rank times, health) records it.
The batch may change between steps: `set_train_batch_size`, `set_train_micro_batch_size` and
the config's `rampup_batch_size` (`engine/batch_change.py`; the layout changes through a checkpoint).
Every communication call lands in `engine.comm_ledger` (`comm.Ledger`): its totals count every call
since its last `clear()`, its `rows` keep the most recent `COMM_LEDGER_MAX_ROWS` calls only.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from tinyscale.config import ConfigError, EngineConfig
from tinyscale.config_deepspeed import gradient_scaling, log_notes, runtime_notes
from tinyscale.data import local_micro_batches
from tinyscale.dist import ParallelMesh, comm, device
from tinyscale.dist.log import get_logger
from tinyscale.data_parallel import BucketedDDP, broadcast_parameters
from tinyscale.data_parallel.bucketed import TORCH_FIRST_BUCKET_MB
from tinyscale.engine import checkpoint, checkpoint_io, compression, context, dcp_checkpoint, parallelize, step_failure
from tinyscale.engine import batch_change  # set_train_batch_size, the ramp-up
from tinyscale.engine import expert  # ep: the groups the failure watch adds
from tinyscale.engine.checkpoint import CheckpointError
from tinyscale.engine.memory import MemoryReport, report_for
from tinyscale.engine.monitor import Monitor
from tinyscale.engine.plan import placements, plan_layout
from tinyscale.engine.step_failure import StepFailed  # re-exported: tinyscale.engine.engine.StepFailed
from tinyscale.engine.grad_norm import GradNorm
from tinyscale.engine.throughput import Throughput
from tinyscale.mfu import StepProfiler
from tinyscale.models.dropout import set_dropout_clock
from tinyscale.moe import moe_stats
from tinyscale.optim import (OptimizerFactory, check_elementwise_state, lr_at, optimizer_factory,
                             schedule_base_lr, set_lr)
from tinyscale.precision import MixedPrecisionOptimizer, make_loss_scaler
from tinyscale.zero import ZeroStage1, ZeroStage2, ZeroStage3
from tinyscale.zero.optimizer import COMM_DTYPES
from tinyscale.zero.stage3 import Wrap


ParamGroups = Callable[[torch.nn.Module], list[dict]]

# `engine.comm_ledger` keeps the rows of the most recent calls only (its totals count every call).
# A step of the toy GPT at tp 2 with 8 blocks and 8 micro-batches (more than any layout in the
# tests) makes 297 calls, ZeRO 3 217, DDP ~10: 8192 rows hold over 25 such steps. A row costs
# ~330 bytes (a Row and its dtype string, tracemalloc) plus its ranks tuple, so ~400: about 3 MB.
COMM_LEDGER_MAX_ROWS = 8192


def check_supported(config: EngineConfig) -> None:
    """Reject what this build cannot do yet, naming the field (before any work is done)."""
    todo = parallelize.check_config(config)  # tensor, context and pipeline parallelism's combinations not served yet
    todo += compression.check_config(config)  # the compression section's refusals
    if todo:
        raise ConfigError("not supported by this engine yet:\n  " + "\n  ".join(todo))


class Engine:
    """Trains `model` with the configured strategy; see the module docstring for one step."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, *, mesh: ParallelMesh | None = None,
                 param_groups: ParamGroups | None = None, zero3_wrap: Wrap = None, peak_flops: float | None = None,
                 optimizer: OptimizerFactory | None = None):
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.device = device()
        notes = runtime_notes(config, has_gpu=self.device.type == "cuda")  # read with the layout, logged below
        # The layout decided once: every refusal in one ConfigError, before any process group is made.
        # From here on the layout (the parallel and zero_optimization sections) is read from the plan.
        self.plan = plan_layout(config, model, world, mesh)
        self.config = config
        make = optimizer_factory(config, optimizer)  # the config's optimizer, or the caller's own
        # A caller's optimizer keeps its own learning rate unless the config has a schedule.
        self._schedules_lr = optimizer is None or config.scheduler is not None
        mesh = parallelize.build_mesh(self.plan, mesh)
        self.mesh = mesh
        self.dp_group = mesh.group("dp") if mesh is not None else None
        self.dp_rank = mesh.rank("dp") if mesh is not None else 0
        self.dp_size = mesh.size("dp") if mesh is not None else 1
        # Gradients are averaged over dp x cp (engine/context.py; just dp without context parallelism).
        self.reduce_group, self.reduce_rank, self.reduce_size = context.reduce_group(mesh)
        self.cp_size = self.plan.cp
        self.batch = config.batch(self.dp_size)
        # the batch may change between steps (engine/batch_change.py): the config's is the lr's reference
        self.config_batch_size, self.samples, self.lr_scale = self.batch.train_batch_size, 0, 1.0
        batch_change.check_rampup(self)
        batch_change.follow_rampup(self)  # rampup_batch_size: the first step's batch
        # DeepSpeed keys accepted with no effect here: said once, with the reason (rank 0).
        self.config_notes = (*config.notes, *notes)
        log_notes(self.config_notes)
        self.model = model.to(self.device)
        # Pipeline partition first: from here on the model holds this rank's stages only, and
        # train_batch runs the schedule (engine/pipeline_step.py); None without parallel.pipeline.
        self.pipeline = parallelize.partition_pipeline(self.model, self.plan, mesh,
                                                       self.batch.gradient_accumulation_steps)
        # Tensor parallel, then activation checkpointing (engine/parallelize.py, the one order);
        # mixed precision and DP/ZeRO below hook into what they leave.
        parallelize.parallelize_model(self.model, self.plan, mesh, pipeline=self.pipeline)
        self.tp_size = self.plan.tp
        self._tp_shapes = {n: p.shape for n, p in self.model.state_dict().items()}  # before ZeRO-3 shards them
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("initialize: the model has no parameter that requires grad")
        # torch-style parameter groups (e.g. no weight decay on norms), built from the model.
        groups = param_groups(self.model) if param_groups is not None else self.params
        self.comm_ledger = comm.Ledger(max_rows=COMM_LEDGER_MAX_ROWS)  # recent rows, totals of all
        self.ddp = self.zero = None
        self._before_step_report: MemoryReport | None = None
        zero = self.plan.zero  # the last transform, DP or ZeRO over dp (x cp), as the plan says
        # Mixed precision (tinyscale.precision): the model computes in fp16/bf16, fp32 masters
        # and states step; fp16 scales the loss. The masters are taken from the parameters'
        # full-precision values before they are rounded, so the optimizer is built first.
        self.compute_dtype = torch.float16 if config.fp16.enabled else torch.bfloat16 if config.bf16.enabled else None
        self.loss_scaler = make_loss_scaler(**config.fp16.model_dump(exclude={"enabled"})) if config.fp16.enabled else None
        self.skipped_steps = 0
        # DeepSpeed counts reduce_bucket_size in elements, not bytes.
        element_size = self.params[0].element_size() if self.compute_dtype is None else 2
        bucket_bytes = zero.reduce_bucket_size * element_size
        # --8<-- [start:overflow-group]
        # fp16's overflow flag is agreed over the whole world, not the reduce group: under tensor,
        # pipeline or context parallelism the other ranks hold the rest of the model (or the rest
        # of the sequence), and a rank that stepped while its peers skipped would tear it apart.
        overflow_group = dist.group.WORLD if dist.is_initialized() else None
        # --8<-- [end:overflow-group]
        with comm.record(self.comm_ledger):  # the initial broadcast is the engine's traffic too
            if self.plan.zero_stage == 0:
                if compression.owns_communication(config):  # 1-bit Adam averages over dp itself; asked for
                    # first, so mixed precision cannot silently replace it (it refuses fp16/bf16 by name)
                    self.optimizer = compression.optimizer(groups, config, self.reduce_group, self.model,
                                                           self.pipeline)
                elif self.compute_dtype is not None:
                    self.optimizer = MixedPrecisionOptimizer(
                        groups, make, dtype=self.compute_dtype,
                        loss_scaler=self.loss_scaler, process_group=overflow_group)  # rounds frozen ones too
                    # --8<-- [start:mixed-precision-clip]
                    if self.tp_size > 1 or self.pipeline is not None or self.plan.ep > 1:  # the whole model's
                        mp = self.optimizer  # norm, each parameter counted once, on the masters
                        self.optimizer.clip_grad_norm_ = lambda max_norm: self.grad_norm().clip_(
                            max_norm, [(p, m.grad) for p, m in zip(mp.params, mp.masters)])
                    # --8<-- [end:mixed-precision-clip]
                else:
                    self.optimizer = make(groups)
                # Data parallelism: full replicas, gradients averaged by the wrapper.
                if self.reduce_size > 1 and not compression.owns_communication(config):
                    # torch DDP's layout: a 1 MiB first bucket goes early, the rest in buckets of
                    # reduce_bucket_size (without overlap_comm all go after backward: no first bucket)
                    self.ddp = BucketedDDP(self.model, process_group=self.reduce_group,
                                           bucket_cap_mb=bucket_bytes / 2**20, overlap=zero.overlap_comm,
                                           first_bucket_cap_mb=TORCH_FIRST_BUCKET_MB if zero.overlap_comm else None)
                    self.ddp.comm_dtype = COMM_DTYPES[config.communication_data_type]  # buckets sent in it
                    self.ddp.prescale_gradients, self.ddp.gradient_predivide_factor = gradient_scaling(config)
                    compression.attach(self.ddp, config, self.reduce_group)  # a hook, if configured
            else:
                # ZeRO: the ranks start identical, then each builds its shards of the state
                # (stage 3: of the parameters too, and hooks on the model that gather them).
                if self.reduce_size > 1:
                    broadcast_parameters(self.model, self.reduce_group)
                off = {"offload_optimizer": zero.offload_optimizer.device, "param_dtype": self.compute_dtype,
                       "loss_scaler": self.loss_scaler, "sub_group_size": zero.sub_group_size,
                       "pin_memory": zero.offload_optimizer.pin_memory}
                if self.plan.zero_stage == 1:  # reduce-scatters in units of at most reduce_bucket_size, in
                    self.zero = ZeroStage1(groups, make, self.reduce_group, **off, bucket_bytes=bucket_bytes,  # the
                                           nvme_path=zero.offload_optimizer.nvme_path,  # last backward (the others
                                           overlap=zero.overlap_comm)  # under no_sync), as DeepSpeed's stage 1
                elif self.plan.zero_stage == 2:
                    self.zero = ZeroStage2(groups, make, self.reduce_group, bucket_bytes=bucket_bytes,
                                           overlap=zero.overlap_comm, **off, nvme_path=zero.offload_optimizer.nvme_path)
                elif self.pipeline is not None:  # stage 3 under a schedule: one unit per stage (pipeline_step.py)
                    self.zero = self.pipeline.zero_stage3(
                        groups, make, self.reduce_group, **off, nvme_path=zero.offload_optimizer.nvme_path,
                        reshard_after_forward=self.plan.pipeline_reshard_after_forward,
                        offload_param=zero.offload_param.device, param_nvme_path=zero.offload_param.nvme_path,
                        pin_param_memory=zero.offload_param.pin_memory)
                else:
                    # overlap_comm: prefetch, i.e. the next unit's all-gather overlaps this one's compute
                    self.zero = ZeroStage3(groups, make, self.reduce_group, module=self.model, wrap=zero3_wrap, **off,
                                           prefetch=zero.overlap_comm,
                                           optimizer_nvme_path=zero.offload_optimizer.nvme_path,
                                           offload_param=zero.offload_param.device,
                                           param_nvme_path=zero.offload_param.nvme_path,
                                           persistence_threshold=zero.stage3_param_persistence_threshold,
                                           pin_param_memory=zero.offload_param.pin_memory)
                self.optimizer = self.zero.sharded.optimizer
                if self.plan.zero_stage in (1, 2):  # reduce_scatter false: all-reduce, keep the slice (DeepSpeed's)
                    self.zero.sharded.reduce_scatter = zero.reduce_scatter
                    self.zero.sharded.allgather_bucket_size = zero.allgather_bucket_size
                    self.zero.agree_usage_early = False  # the flags ride on the loss all-reduce
                else:  # stage 3's prefetch bounds, in elements (DeepSpeed's; zero/stage3_prefetch.py)
                    self.zero.prefetch_bucket_size = zero.stage3_prefetch_bucket_size
                    self.zero.max_live_parameters = zero.stage3_max_live_parameters
                self.zero.sharded.overflow_group = overflow_group
                self.zero.sharded.comm_dtype = COMM_DTYPES[config.communication_data_type]
                self.zero.sharded.prescale_gradients, self.zero.sharded.gradient_predivide_factor = \
                    gradient_scaling(config)
                if self.tp_size > 1 or self.pipeline is not None:  # the norm over the TP shards and the
                    self.zero.sharded.clip_grad_norm_ = lambda max_norm: self.grad_norm().clip_shards_(max_norm)
                if self.compute_dtype is not None:  # frozen parameters compute in it too; buffers
                    with torch.no_grad():              # (the GPT's fp32 RoPE tables) stay as they are
                        for p in self.model.parameters():
                            if not p.requires_grad and p.is_floating_point():
                                p.data = p.data.to(self.compute_dtype)
        # the lr a config's scheduler scales: the optimizer's own (a caller's may differ from the config's)
        self._lr_base = schedule_base_lr(self._torch_optimizer(), config) if self._schedules_lr else None
        self._grad_norm: GradNorm | None = None
        self.last_grad_norm: float | None = None  # stage 0 fp32: the last clipping norm (monitor.grad_norm_of)
        self._pending: concurrent.futures.Future | None = None  # an async save in flight
        self._checkpoint_group = None  # its gloo group, made at the first async save
        self.step = 0
        self._broken: str | None = None  # why this engine cannot take another step, if it cannot
        # tp or cp: a rank raising mid-forward leaves its peers inside the model's collectives;
        # they give up and every rank agrees over a group of its own (engine/step_failure.py)
        # (ep: a rank's peers wait for it in the MoE layers' all-to-alls, engine/expert.py)
        self._failure_watch = step_failure.FailureWatch([mesh.group("tp"), mesh.group("cp"), *expert.watched(
            mesh, self.plan)]) if (self.tp_size > 1 or self.cp_size > 1 or self.plan.ep > 1) else None
        # On a GPU each rank is a device; CPU ranks share one machine, whose peak is measured whole.
        self.throughput = Throughput(self.model, config, self.device, peak=peak_flops,
                                     num_devices=self.reduce_size * self.tp_size * self.plan.pp
                                     if self.device.type == "cuda" else 1, tp=self.tp_size, cp=self.cp_size,
                                     cp_algorithm=self.plan.context_algorithm, cp_sharding=self.plan.context_sharding)
        self.last_step: dict = {}
        self._clock = time.perf_counter  # tests script it
        # wall_clock_breakdown (DeepSpeed's name): forward / backward / optimizer / exposed
        # communication per step, `engine.profiler.records` (tinyscale.mfu.StepProfiler).
        self.profiler = StepProfiler(enabled=config.wall_clock_breakdown, device=self.device)
        # tensorboard, csv_monitor, per-rank times, stragglers, health (engine/monitor.py)
        self.monitor = Monitor(config, self.device)

    # --8<-- [start:train-batch]
    def train_batch(self, batch: Sequence[torch.Tensor]) -> float:
        """One optimizer step over the global batch; returns its mean loss (same on every rank)."""
        start = self._clock()
        batch = tuple(batch)
        rows = batch[0].shape[0]
        if rows != self.batch.train_batch_size:
            raise ValueError(
                f"train_batch: the batch has {rows} rows but train_batch_size is "
                f"{self.batch.train_batch_size} (= {self.batch.micro_batch_size} micro x "
                f"{self.batch.gradient_accumulation_steps} accumulation x {self.dp_size} dp)"
            )
        with self.profiler.step(tokens=batch[0].numel()):  # wall_clock_breakdown: else a no-op
            mean_loss, skipped = self._step(batch)
        self._after_step(batch, start, mean_loss, skipped)
        return mean_loss

    def _after_step(self, batch: Sequence[torch.Tensor], start: float, mean_loss: float, skipped: bool) -> None:
        """The step's record (`last_step`), the monitor, the progress line; `batch`: the global
        batch or a tensor of its shape (the loop of `tinyscale.deepspeed` passes a meta tensor)."""
        self.last_step = {"step": self.step - 1, "loss": mean_loss, "skipped": skipped,
                          **self.throughput.record(batch, self._clock() - start)}
        self.samples += batch[0].shape[0]  # DeepSpeed's global_samples (the batch may change)
        batch_change.follow_rampup(self)  # rampup_batch_size: the next step's batch
        if self.plan.moe:  # an MoE GPT: this rank's last micro-batch's routing (load, dropped, aux losses)
            self.last_step["moe"] = moe_stats(self.model)
        if self.profiler.enabled:
            self.last_step["profile"] = self.profiler.records[-1].breakdown.as_dict()
            if self.pipeline is not None:  # the schedule's seconds and this rank's bubble in them
                self.last_step["profile"] |= self.pipeline.profile(self.last_step["profile"])
        self.monitor.record(self)  # every rank: with wall_clock_breakdown it gathers the ranks' times
        if self.step % self.config.steps_per_print == 0:  # DeepSpeed's progress line
            self._print_progress(mean_loss, skipped)

    def _print_progress(self, mean_loss: float, skipped: bool) -> None:
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        line = f"step {self.step}: loss {mean_loss:.6g}"
        if self._schedules_lr:  # the lr this step used (a skipped step used the next one's)
            line += f", lr {self.lr_at(self.step - 1 - self.skipped_steps + int(skipped)):.6g}"
        if self.loss_scaler is not None:
            line += f", loss scale {self.loss_scaler.scale:g}, skipped steps {self.skipped_steps}"
        logging.getLogger("tinyscale.engine").info(line)

    def _step(self, batch: tuple[torch.Tensor, ...]) -> tuple[float, bool]:
        if self._broken is not None:
            raise RuntimeError(f"train_batch: this engine cannot continue: {self._broken}; start a new "
                               "engine from the last checkpoint")
        if self.pipeline is not None:
            return self.pipeline.train_step(self, batch)
        if not all(m.training for m in self.model.modules()):  # (a look is cheaper than train()'s
            self.model.train()                                   # setattr on every module, each step)
        if self.zero is not None:
            self.zero.abandon_backward()  # nothing to forget unless a caller ran backward itself
        micro = local_micro_batches(batch, dp_rank=self.dp_rank, dp_size=self.dp_size,
                                    micro_batch_size=self.batch.micro_batch_size)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        forward = self.ddp if self.ddp is not None else self.model
        phase = self.profiler.phase
        # a dropped step must not have drawn random numbers (dropout): its draws are undone
        rng = (torch.random.get_rng_state(), torch.cuda.get_rng_state() if self.device.type == "cuda" else None,
               parallelize.rng_state(self.model))
        hooked = compression.snapshot(self.ddp)  # a compression hook's residuals, memories, streams
        error, i, skip_reduce = None, 0, False
        watch = self._failure_watch
        with comm.record(self.comm_ledger), watch.attempt_step() if watch else contextlib.nullcontext():
            try:
                parallelize.skip_dropout_masks(self.model, self.plan, micro, self.dp_rank)  # exact TP dropout
                # --8<-- [start:accumulate]
                for i, chunk in enumerate(micro):
                    last = i == len(micro) - 1
                    # counter dropout: this step and the micro-batch's first row in the global batch
                    set_dropout_clock(self.model, step=self.step, row0=(self.dp_rank * len(micro) + i) * len(chunk[0]))
                    # Gradients are averaged once per step: by the last micro-batch's backward.
                    with contextlib.nullcontext() if last else self.accumulate_only():
                        with phase("forward"):
                            # context parallel: this rank's sequence shard (else the chunk itself)
                            shard = context.shard_micro_batch(chunk, self.model)
                            loss = forward(*(t.to(self.device) for t in shard))
                        with phase("backward"):  # x cp: the mean over dp x cp ranks sums over cp
                            self._scaled(loss * self.cp_size / len(micro)).backward()
                    total += loss.detach().double()
                # --8<-- [end:accumulate]
                parallelize.skip_dropout_masks(self.model, self.plan, micro, self.dp_size - 1 - self.dp_rank)
            except Exception as exc:  # noqa: BLE001 - every rank hears of it below, then it is re-raised
                error = exc
                if watch is not None:
                    watch.post()  # peers waiting for this rank in the model's collectives give up
                # dp ops over a watched group (cp): its peers give up on this rank instead
                skip_reduce = watch is not None and watch.covers(self.reduce_group)
                if not skip_reduce:
                    self._complete_abandoned(len(micro) - i)
            total, failed, used, error = self._agree_step(total, error, skip_reduce)
        return self._finish_step(total, failed, used, len(micro), error, rng, hooked)

    def accumulate_only(self):
        """The context of a micro-batch's backward that is not the step's last: DDP's and ZeRO 1's
        `no_sync` (the last backward reduces the sum once); stage 2 reduces every micro-batch."""
        if self.ddp is not None:
            return self.ddp.no_sync()
        return self.zero.no_sync() if isinstance(self.zero, ZeroStage1) else contextlib.nullcontext()

    def _agree_step(self, total: torch.Tensor, error: Exception | None, skip_reduce: bool = False) -> tuple:
        """(summed loss, failed flags, used flags, error) over the reduce group, in one all-reduce.
        ZeRO: which parameters got a gradient on this rank rides along with the loss, so that those
        no rank used are not stepped (as in one process) at no extra collective; so does whether
        this rank's forward or backward raised."""
        used = self.zero.sharded.used_here().to(self.device) if self.zero is not None else None
        failed = torch.zeros(self.reduce_size, dtype=torch.float64, device=self.device)
        failed[self.reduce_rank] = float(error is not None)
        if self.reduce_size > 1 and not (error is not None and skip_reduce):  # cp ranks report
            sent = torch.cat([total.reshape(1), failed] + ([] if used is None else [used]))  # the same loss
            try:
                comm.all_reduce(sent, group=self.reduce_group)
            except step_failure.PeerFailed as exc:  # only on a watched group: the step is dropped
                error = exc
            total, failed = sent[0], sent[1:1 + self.reduce_size]
            used = None if used is None else sent[1 + self.reduce_size:]
        return total, failed, used, error

    def _finish_step(self, total: torch.Tensor, failed: torch.Tensor, used: torch.Tensor | None, num_micro: int,
                     error: Exception | None, rng: tuple, hooked) -> tuple[float, bool]:
        """The rest of a step once every micro-batch's backward ran and `_agree_step` agreed
        (train_batch's loop above, or a script's loop: `tinyscale.deepspeed`): drop or clip and step."""
        watch = self._failure_watch
        used = None if used is None else used.cpu() > 0
        mean_loss = total.item() / (num_micro * self.reduce_size)
        failed_ranks, where = [r for r, f in enumerate(failed.tolist()) if f], "dp rank(s)"
        if watch is not None:  # a TP or cp peer's failure too: the whole world drops the step together
            with comm.record(self.comm_ledger):
                failed_ranks, abandoned = watch.agree(error)
            where = "rank(s)"
            if abandoned:  # the model's groups are out of step: no later step can be trusted
                self._roll_back(rng)
                self._broken = step_failure.broken_message(self.step, failed_ranks, abandoned)
                if error is not None and not isinstance(error, step_failure.PeerFailed):
                    raise error
                raise StepFailed(self._broken)
        # The same value on every rank, so all raise together. fp16: an overflow is the
        # scaler's business (the step is skipped below), not divergence.
        diverged = not math.isfinite(mean_loss) and self.loss_scaler is None
        if failed_ranks or diverged:
            self._roll_back(rng)
            compression.restore(self.ddp, hooked)  # every rank ran the hooks for the dropped step
        if error is not None:
            raise error
        if failed_ranks:
            raise StepFailed(f"train_batch: step {self.step} raised on {where} {failed_ranks} (see the error "
                             "there); every rank dropped the step, so the engine is as it was before it: retry "
                             "the batch or skip it")
        if diverged:
            raise FloatingPointError(f"train_batch: the loss at step {self.step} is {mean_loss}; training diverged "
                                     "(the step was dropped on every rank)")
        if hooked is not None:  # error feedback keeps the residual of a parameter no rank used
            compression.keep_unsent(self.ddp, hooked)
            if self.tp_size > 1:  # TP copies of a replicated parameter: their owner's compressed mean
                with comm.record(self.comm_ledger):
                    compression.after_sync(self, self.model.tp_group)
        self._before_step_report = self.memory_report()  # the step's peak of model states
        # a skipped step does not advance the schedule
        lr = self.lr_at(self.step - self.skipped_steps) if self._schedules_lr else None
        skipped = False
        try:
            # ZeRO's gathers, fp16's overflow flag
            with self.profiler.phase("optimizer"), comm.record(self.comm_ledger):
                if self.zero is not None:
                    if lr is not None:
                        self.zero.set_lr(lr)
                    skipped = self.zero.step(max_norm=self.config.gradient_clipping, used=used)
                    if self.step == self.skipped_steps:  # the first step taken: the states now exist
                        check_elementwise_state(self.optimizer)
                elif self.compute_dtype is not None:
                    if lr is not None:
                        set_lr(self.optimizer, lr)
                    skipped = self.optimizer.step(max_norm=self.config.gradient_clipping)
                    self.optimizer.zero_grad(set_to_none=True)
                else:
                    if self.config.gradient_clipping > 0 and (self.tp_size > 1 or self.plan.ep > 1):  # the model's norm
                        self.last_grad_norm = self.grad_norm().clip_(self.config.gradient_clipping,
                                                                     [(p, p.grad) for p in self.params])
                    elif self.config.gradient_clipping > 0:  # the norm kept for the monitor (engine/monitor.py)
                        self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params,
                                                                                   self.config.gradient_clipping))
                    if lr is not None:
                        set_lr(self.optimizer, lr)
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
        except Exception as exc:
            # Parameters, states or shards may be partly updated: no way back to before the step.
            self._broken = f"step {self.step} raised in the optimizer step ({type(exc).__name__}: {exc})"
            raise
        self.skipped_steps += int(skipped)
        self.step += 1
        return mean_loss, skipped
    # --8<-- [end:train-batch]

    def lr_at(self, applied_steps: int) -> float:
        """The lr of the `applied_steps`-th applied step: the config's schedule, times the batch
        change's scaling (`set_train_batch_size(..., lr_scaling=...)`; 1 otherwise)."""
        return lr_at(applied_steps, self.config, self._lr_base) * self.lr_scale

    def set_train_batch_size(self, train_batch_size: int, *, lr_scaling: str | None = None) -> None:
        """DeepSpeed's: the global batch of the next steps, by gradient_accumulation_steps (micro
        and dp kept); a ValueError if it is not a multiple of micro x dp. Call on every rank between
        steps, with the same values. `lr_scaling` (tinyscale's): None, "linear" or "sqrt" scales
        the lr by the new batch over the config's (engine/batch_change.py)."""
        batch_change.apply(self, batch_change.with_train_batch_size(self.batch, train_batch_size), lr_scaling,
                           f"set_train_batch_size({train_batch_size!r})")

    def set_train_micro_batch_size(self, micro_batch_size: int, *, lr_scaling: str | None = None) -> None:
        """DeepSpeed's: micro-batches of `micro_batch_size` rows, accumulation kept, so the global
        batch becomes micro x accumulation x dp (call on every rank between steps)."""
        batch_change.apply(self, batch_change.with_micro_batch_size(self.batch, micro_batch_size), lr_scaling,
                           f"set_train_micro_batch_size({micro_batch_size!r})")

    def _complete_abandoned(self, micro_batches_left: int) -> None:
        """This rank's forward or backward raised: make the collectives the other ranks make
        in the rest of the step (they must not wait for it), then forget this rank's part."""
        if self.reduce_size > 1:
            if self.ddp is not None:
                self.ddp.complete_abandoned()
            elif self.zero is not None:
                # False only at stage 3 before any micro-batch completed (its sequence of gathers
                # unknown): then recovery works if every rank raised at the same point (an error
                # of the model or the batch); a rank failing alone there is not recoverable.
                self.zero.complete_abandoned(micro_batches_left)

    def _roll_back(self, rng: tuple) -> None:
        """Drop everything the step made (gradients, usage, random draws): as before it."""
        for p in self.model.parameters():
            p.grad = None
        if self.ddp is not None:
            self.ddp._abandon_backward()
        if self.zero is not None:
            self.zero.abandon_backward()
        torch.random.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1])
        parallelize.restore_rng(self.model, rng[2])

    def grad_norm(self) -> GradNorm:
        """The clipping norm's bookkeeping (engine/grad_norm.py), built from the placements at first use."""
        if self._grad_norm is None:
            self._grad_norm = GradNorm(self)
        return self._grad_norm

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.loss_scaler is None else self.loss_scaler.scale_loss(loss)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters and buffers on CPU, same on every rank, keyed like the model's state_dict().

        Each rank contributes the pieces of the single-process model it owns (the placements, as
        for a checkpoint), and every rank places all of them by their global offsets (call it on
        every rank; `engine/dcp_checkpoint.py`)."""
        return dcp_checkpoint.full_state_dict(self)

    def save_checkpoint(self, path, client_state: dict | None = None, *, blocking: bool = True):
        """Write everything an exact resume needs to directory `path` (call on every rank).

        Parameters, optimizer state, loss scaler, step and schedule position, every rank's
        random state, and `client_state` (JSON: e.g. the data position) returned by
        `load_checkpoint`. Every rank writes only the pieces of the single-process model it
        owns, through torch.distributed.checkpoint (`engine/dcp_checkpoint.py`: the format is
        the same for every layout); rank 0 commits the version, crash-safe
        (`tinyscale.engine.checkpoint_io`), once every rank's files are written.

        `blocking=False` (async save, DCP's `async_save` idea): this rank's pieces are copied to
        host memory, then written and committed by a background thread over a gloo group of
        its own while training goes on; returns a future (`.result()` waits, and raises what
        the save raised). `latest` moves only once every rank's write succeeded. The next
        save or load waits for it first; `wait_checkpoint()` does too."""
        self.wait_checkpoint()
        client_state = {} if client_state is None else client_state
        try:
            json.dumps(client_state)
        except TypeError as exc:
            raise ValueError(f"save_checkpoint: client_state must be JSON (numbers, strings, lists, dicts): {exc}") \
                from None
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        mine = {**checkpoint.rng_state(self.device), **parallelize.rng_state(self.model)}  # + TP's tracker
        local = compression.local_state(self)  # per-rank residuals and errors travel with the random state
        if local is not None:
            mine["compression"] = local
        started: list = [None]
        error = None
        if rank == 0:
            try:
                tmp, name = checkpoint_io.begin(path)
                started = [(str(tmp), name)]
            except Exception as exc:  # noqa: BLE001 - re-raised below, after telling the other ranks
                error = exc
        if world > 1:
            dist.broadcast_object_list(started, src=0)
        if started[0] is None:
            raise error if error is not None else CheckpointError(
                f"save_checkpoint: rank 0 could not start a version in {path}; see its error")
        tmp, name = Path(started[0][0]), started[0][1]
        meta = {"step": self.step, "skipped_steps": self.skipped_steps, "samples": self.samples,
                "world_size": world, "dp": self.dp_size,
                "optimizer_class": type(self._torch_optimizer()).__name__,
                "config": self.config.model_dump(mode="json"), "client_state": client_state}
        if blocking:
            files = dcp_checkpoint.save(self, tmp, mine)  # DCP raises on every rank if one fails
            self._commit(path, tmp, name, meta, files, local is not None)
            return None
        tensors, objects = dcp_checkpoint.snapshot(self, mine)
        if self._checkpoint_group is None and world > 1:  # its own group: the training's collectives go on
            self._checkpoint_group = dist.new_group(backend="gloo")
        group = self._checkpoint_group

        def background() -> None:
            files = dcp_checkpoint.write(tmp, tensors, objects, group)
            self._commit(path, tmp, name, meta, files, local is not None, group)

        self._pending = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint").submit(background)
        return self._pending

    def wait_checkpoint(self) -> None:
        """Wait for an async save in flight (`save_checkpoint(..., blocking=False)`); raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _commit(self, path, tmp: Path, name: str, meta: dict, files: list[str], compressed: bool,
                group=None) -> None:
        """Every rank's files written: their checksums to rank 0, which commits; every rank learns
        whether that succeeded (over `group`), so none waits forever."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        here = (dcp_checkpoint.file_digests(tmp, files), compressed)
        written = [here]
        if dist.is_initialized() and dist.get_world_size() > 1:
            written = [None] * dist.get_world_size()
            dist.all_gather_object(written, here, group=group)
        error = None
        if rank == 0:
            try:
                checkpoint_io._reach("files_written")
                digests = {k: v for d, _ in written for k, v in d.items()}
                digests.update(dcp_checkpoint.file_digests(tmp, [".metadata"]))
                checkpoint_io.commit(path, tmp, name, {**meta, "compression_state": any(c for _, c in written)},
                                     digests)
            except Exception as exc:  # noqa: BLE001 - re-raised below, after telling the other ranks
                error = exc
        if dist.is_initialized() and dist.get_world_size() > 1:
            said = [None] * dist.get_world_size()
            dist.all_gather_object(said, None if error is None else str(error), group=group)
            if said[0] is not None and error is None:
                raise CheckpointError(f"save_checkpoint: rank 0 failed to commit {path}: {said[0]}")
        if error is not None:
            raise error

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer.optimizer if isinstance(self.optimizer, MixedPrecisionOptimizer) else self.optimizer

    def _agree(self, error: Exception | None, path) -> None:
        """Every rank raises if any rank failed, naming that rank's problem (none waits in a collective)."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            said = [None] * dist.get_world_size()
            dist.all_gather_object(said, None if error is None else str(error))
            failed = [(r, m) for r, m in enumerate(said) if m is not None]
            if failed and error is None:
                r, m = failed[0]
                raise CheckpointError(f"load_checkpoint: rank {r} could not load {path}: {m}")
        if error is not None:
            raise error

    def load_checkpoint(self, path) -> dict:
        """Resume from directory `path`, written by any layout (call on every rank); returns the
        `client_state` it was saved with.

        Each rank reads only the pieces its layout needs (`engine/dcp_checkpoint.py`). In the
        same world size it continues bit-for-bit, random draws included; in another, all but
        the stream random draws do (`checkpoint.restore_rng`). Refused with the differences
        named (`CheckpointError`, on every rank) if a file is missing or damaged, or the
        checkpoint holds another optimizer's state, other parameter names or shapes. The new
        config wins over the saved one: hyperparameters (lr, weight decay, betas, ...) are this
        engine's, and rank 0 logs what changed."""
        self.wait_checkpoint()
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        error = version = meta = metadata = None
        try:
            version = Path(path)
            if (version / ".metadata").is_file() and not (version / "meta.json").is_file():
                # a plain DCP checkpoint (torch's FSDP2, torchtitan): no checksums, step or random state
                meta = {"format_version": checkpoint_io.FORMAT_VERSION, "sha256": {}, "step": 0, "world_size": None}
            else:
                version = checkpoint_io.live_version(path)
                meta = checkpoint_io.read_meta(version)
            if meta["format_version"] < checkpoint_io.FORMAT_VERSION:
                raise CheckpointError(f"load_checkpoint: {version} is an older tinyscale's single-file checkpoint "
                                      f"(format {meta['format_version']}): convert it with `tinyscale checkpoint "
                                      "import` (or load it with the version that wrote it)")
            problem = dcp_checkpoint.check_files(version, meta["sha256"], rank, world)
            if problem is not None:
                raise CheckpointError(f"load_checkpoint: {problem}")
        except Exception as exc:  # noqa: BLE001 - every rank hears of it: none waits in a collective
            error = exc
        self._agree(error, path)
        try:
            metadata = dcp_checkpoint.read_metadata(version)
            checkpoint.check_compatible(path, meta, dcp_checkpoint.saved_shapes(metadata), self._global_shapes(),
                                        type(self._torch_optimizer()).__name__)
            if self.config.compression.type != "none":
                compression.check_resume(meta["world_size"], world, {0: {"compression": meta.get("compression_state")}})
        except Exception as exc:  # noqa: BLE001
            error = exc
        self._agree(error, path)
        keys = set(metadata.state_dict_metadata)
        wanted = [k for k in keys if k.startswith(dcp_checkpoint.GROUPS) and k.endswith(".params")]
        wanted += [k for k in (dcp_checkpoint.SCALER, f"{dcp_checkpoint.RANK}{rank}", f"{dcp_checkpoint.RANK}0")
                   if k in keys]
        objects = dcp_checkpoint.read_objects(version, sorted(set(wanted)))
        ours = [g["params"] for g in dcp_checkpoint._group_table(self, dcp_checkpoint.held(self))]
        theirs = [objects[k] for k in sorted((k for k in objects if k.startswith(dcp_checkpoint.GROUPS)),
                                             key=lambda k: int(k[len(dcp_checkpoint.GROUPS):].split(".")[0]))]
        if theirs and ours != theirs:  # none: a model-only checkpoint (imported): the optimizer starts fresh
            error = CheckpointError(
                f"load_checkpoint: {path}: the checkpoint's optimizer covers different parameters than this "
                f"engine's (saved groups {theirs}, here {ours}); was it written for another model, or "
                "with other parameters frozen or grouped differently?")
        self._agree(error, path)
        dcp_checkpoint.load(self, version, metadata)
        if self.loss_scaler is not None and dcp_checkpoint.SCALER in objects:
            self.loss_scaler.load_state_dict(objects[dcp_checkpoint.SCALER])
        self.step, self.skipped_steps = meta["step"], meta.get("skipped_steps", 0)
        self.samples = meta.get("samples", self.step * self.batch.train_batch_size)  # older: one batch size
        batch_change.follow_rampup(self)  # rampup_batch_size: where the samples trained put it
        ranks = {r: objects[f"{dcp_checkpoint.RANK}{r}"] for r in (0, rank) if f"{dcp_checkpoint.RANK}{r}" in objects}
        saved_rng = {"world_size": meta["world_size"], "ranks": ranks} if ranks else None
        warning = checkpoint.restore_rng(saved_rng, rank, world, self.device)
        if saved_rng is not None:  # tensor parallelism's tracker stream (same world: exact)
            parallelize.restore_rng(self.model, ranks.get(rank))
            compression.load_local_state(self, ranks.get(rank, {}).get("compression"))
        changes = checkpoint.config_changes(meta.get("config"), self.config.model_dump(mode="json"))
        if rank == 0 and (changes or warning):
            log = get_logger("tinyscale.checkpoint")
            if changes:
                log.info("load_checkpoint %s: the config differs from the checkpoint's; using the new values: %s",
                         path, "; ".join(changes))
            if warning:
                log.warning("load_checkpoint %s: %s", path, warning)
        return meta.get("client_state", {})

    def _global_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter of the original model (all stages): name -> shape (a small all-gather)."""
        mine = {k: tuple(pl.global_shape) for k, pl in placements(self, include_frozen=True).items()}
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return mine
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        return {k: v for part in parts for k, v in part.items()}

    def memory_report(self, when: str = "now") -> MemoryReport:
        """Bytes this rank holds, by category, counted from the tensors it holds.

        ``when="now"``: right now (between steps: no gradients). ``when="before_step"``: as
        they were in the last step after backward, before the optimizer step, the moment
        model states peak (full gradients for stage 0, gradient shards for stages 1 to 3: stage 1
        holds full ones between micro-batches, until its last backward reduces them).
        """
        if when == "before_step":
            if self._before_step_report is None:
                raise ValueError("memory_report(when='before_step') needs one train_batch first")
            return self._before_step_report
        if when != "now":
            raise ValueError(f"memory_report: when must be 'now' or 'before_step', got {when!r}")
        extra = None
        if self.zero is not None:
            extra = {"master_weights": self.zero.sharded.master, "gradients": self.zero.sharded.grad}
            if isinstance(self.zero, ZeroStage3):  # its parameters are shards (plus frozen ones, full)
                extra["parameters"] = self.zero.shards.resident()
        for swap in self._swappers():
            swap.flush()  # writes in flight still hold their memory: let them land first
        optimizer = self.optimizer
        if isinstance(optimizer, MixedPrecisionOptimizer):
            optimizer, extra = optimizer.optimizer, {"master_weights": optimizer.masters}
        report = report_for(self.model, optimizer, self.device, extra)
        if self.zero is not None:  # the disk tier: what is in files now, not in memory
            swap = self.zero.sharded.swap
            if swap is not None:
                masters = [k for k in swap.keys() if k.endswith("/master")]
                report.add("master_weights", "disk", swap.disk_bytes(masters))
                report.add("optimizer_states", "disk", swap.disk_bytes() - swap.disk_bytes(masters))
            if isinstance(self.zero, ZeroStage3):
                report.add("parameters", "disk", self.zero.shards.disk_bytes())
        return report

    def _swappers(self) -> list:
        if self.zero is None:
            return []
        swaps = [self.zero.sharded.swap, self.zero.shards.swap if isinstance(self.zero, ZeroStage3) else None]
        return [s for s in swaps if s is not None]


def initialize(model: torch.nn.Module, config, *, mesh: ParallelMesh | None = None,
               param_groups: ParamGroups | None = None, zero3_wrap: Wrap = None,
               peak_flops: float | None = None, optimizer: OptimizerFactory | None = None) -> Engine:
    """Wrap `model` in an `Engine` for `config` (dict, .json/.yaml path or EngineConfig).

    Call on every rank (inside `tinyscale.dist.launch` or torchrun), or in a plain process.
    `param_groups(model)` may return torch-style groups (dicts with "params" and overrides
    such as "weight_decay"; not "lr": the schedule sets every group's lr);
    `tinyscale.reference.train` takes the same callable. `zero3_wrap` (stage 3 only) names
    the modules that become units (names, or a predicate on (name, module)); default: every
    element of every nn.ModuleList (see `tinyscale.zero.stage3`). `peak_flops`: one device's
    peak FLOP/s for MFU in `engine.last_step` (default: the vendor table on CUDA; see
    `tinyscale.engine.throughput`). `optimizer`: your own optimizer instead of the config's
    `optimizer` section: a `torch.optim.Optimizer` subclass or a callable `groups -> Optimizer`;
    the contract it keeps is in `tinyscale.optim.optimizer_factory`.
    """
    return Engine(model, EngineConfig.load(config), mesh=mesh, param_groups=param_groups, zero3_wrap=zero3_wrap,
                  peak_flops=peak_flops, optimizer=optimizer)
