"""`DeepSpeedEngine`: DeepSpeed's training-loop surface over tinyscale's `Engine`.

    loss = engine(inputs, labels)          # forward: the module's output, whatever it is
    engine.backward(loss)                  # loss / gradient_accumulation_steps, backward
    engine.step()                          # steps only at an accumulation boundary

One optimizer step is `gradient_accumulation_steps` forward/backward/step calls. The first
forward of a step opens it (the random state a dropped step restores, the dropout clock, the
profiler's step); every backward but the boundary's runs under ``no_sync`` (stages 0 and 1),
so gradients are averaged once; the boundary's ``step()`` finishes it with the engine's own
code (`Engine._agree_step`, `_finish_step`: the loss, failure and used-parameter agreement, fp16's overflow
check, clipping, the schedule's lr, the optimizer step). Fed the micro-batches
`train_batch` cuts from a global batch, the loop equals `train_batch` bit for bit
(``pytest -k deepspeed_api``).

Served: tensor parallelism and every ZeRO stage, fp16/bf16, clipping, compression,
`compile(backend, compile_kwargs)` (torch.compile of the GPT's blocks, engine/compiled.py), and
`set_train_batch_size` / `set_train_micro_batch_size` between steps (engine/batch_change.py). With
``parallel.pipeline``, `train_batch(data_iter=...)` as DeepSpeed's PipelineEngine (the loop
cannot drive a schedule); ``parallel.context`` is refused at `initialize` (a module's forward
there returns its sequence shard's loss, not the batch's). DeepSpeed methods not served raise
`NotImplementedError` naming the method and what to use (`REFUSED`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist

from tinyscale.dist import comm
from tinyscale.dist.log import get_logger
from tinyscale.config import CompileConfig
from tinyscale.engine import compiled, compression, parallelize
from tinyscale.engine.engine import Engine
from tinyscale.models.dropout import set_dropout_clock

# DeepSpeed engine methods this wrapper does not serve, with why and what to use instead.
REFUSED = {
    "eval_batch": "a pipeline's evaluation schedule is not built; evaluate with engine.eval() and engine(inputs)",
    "no_sync": "the engine already accumulates without communication until the boundary's backward",
    "set_gradient_accumulation_boundary": "the boundary follows gradient_accumulation_steps (DeepSpeed's "
                                          "managed accumulation); change that in the config",
    "save_16bit_model": "save_checkpoint writes full-precision parameters; engine.full_state_dict() gives "
                        "them on every rank",
}


class DeepSpeedEngine:
    """What `tinyscale.deepspeed.initialize` returns first: see the module docstring."""

    def __init__(self, engine: Engine, *, local_rank: int):
        self.engine = engine
        self.local_rank = local_rank
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.micro_steps = 0
        self._in_step = 0  # micro-batches of the open step already stepped
        self._total: torch.Tensor | None = None  # the open step's summed micro-batch losses
        self._window: contextlib.ExitStack | None = None  # open from a step's first forward to its step()
        self._rng: tuple | None = None
        self._hooked = None
        self._start = 0.0
        self._first_micro: tuple | None = None

    # -- what DeepSpeed's engine reports --------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.engine.model

    @property
    def optimizer(self):
        return self.engine.optimizer

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def global_steps(self) -> int:
        return self.engine.step

    @property
    def global_samples(self) -> int:
        return self.engine.samples  # the batch may change between steps

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    @property
    def dp_world_size(self) -> int:
        return self.engine.dp_size

    @property
    def monitor(self):
        return self.engine.monitor

    def get_lr(self) -> list[float]:
        """Every parameter group's lr: the last step's (after the first step, the schedule's)."""
        return [g["lr"] for g in self.engine._torch_optimizer().param_groups]

    def zero_optimization_stage(self) -> int:
        return self.engine.config.zero_optimization.stage

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.engine.batch.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.engine.batch.train_batch_size

    def is_gradient_accumulation_boundary(self) -> bool:
        """True during the micro-batch whose step() steps: the open step's last. DeepSpeed 0.19.8
        tests micro_steps + 1 divisible by gas, the same while gas is fixed; after
        set_train_batch_size at a micro_steps that is not a multiple of the new gas, its next
        step comes early, with fewer micro-batches (tinyscale counts the open step's)."""
        return self._in_step + 1 == self.gradient_accumulation_steps()

    # --8<-- [start:set-batch]
    def set_train_batch_size(self, train_batch_size: int, *, lr_scaling: str | None = None) -> None:
        """DeepSpeed's: the global batch of the next steps, by gradient_accumulation_steps (micro
        and dp kept; `Engine.set_train_batch_size`, engine/batch_change.py). Between steps only."""
        self._between_steps("set_train_batch_size")
        self.engine.set_train_batch_size(train_batch_size, lr_scaling=lr_scaling)

    def set_train_micro_batch_size(self, micro_batch_size: int, *, lr_scaling: str | None = None) -> None:
        """DeepSpeed's: micro-batches of `micro_batch_size` rows, accumulation kept. The training
        data loader keeps its micro-batch (as DeepSpeed's): feed the new one's rows yourself."""
        self._between_steps("set_train_micro_batch_size")
        self.engine.set_train_micro_batch_size(micro_batch_size, lr_scaling=lr_scaling)

    def _between_steps(self, what: str) -> None:
        if self._window is not None:
            raise RuntimeError(f"{what} inside an open step: its {self._in_step + 1} micro-batch(es) were scaled "
                               f"by 1 / gradient_accumulation_steps = 1/{self.gradient_accumulation_steps()}; "
                               "call it after the boundary's step()")
    # --8<-- [end:set-batch]

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.engine.model.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        return self.train(False)

    def __getattr__(self, name: str):
        if name in REFUSED:
            raise NotImplementedError(f"DeepSpeedEngine.{name} is not served by tinyscale: {REFUSED[name]}")
        raise AttributeError(f"'DeepSpeedEngine' has no attribute {name!r} (tinyscale's own engine: "
                             "engine.engine; the API table: docs/deepspeed-config.md)")

    # --8<-- [start:compile]
    def compile(self, backend: str = "inductor", compile_kwargs: dict | None = None, schedule=None,
                compiled_autograd_enabled: bool = False) -> None:
        """DeepSpeed's `engine.compile`: torch.compile, here of the GPT's blocks (engine/compiled.py);
        the same as config `compile: {"enabled": true, "backend": ..., "compile_kwargs": ...}`.
        A second call does nothing. DeepCompile's schedule and compiled autograd are refused."""
        if schedule is not None or compiled_autograd_enabled:
            raise NotImplementedError("DeepSpeedEngine.compile: schedule (DeepCompile's pass schedule) and "
                                      "compiled_autograd_enabled are not served; tinyscale compiles the blocks' "
                                      "forward and backward graphs, and keeps ZeRO's hooks eager")
        if self.is_compiled:
            return
        kwargs = {k: v for k, v in (compile_kwargs or {}).items() if k != "backend"}  # DeepSpeed: overridden
        config = self.engine.config.model_copy(update={"compile": CompileConfig(
            enabled=True, backend=backend, compile_kwargs=kwargs)})
        compiled.check_layout(config, self.engine.model)  # ConfigError naming what cannot be compiled
        compiled.compile_blocks(self.engine.model, config.compile)
        self.engine.config = config

    @property
    def is_compiled(self) -> bool:
        return self.engine.config.compile.enabled
    # --8<-- [end:compile]

    # -- the loop -------------------------------------------------------------------------------
    def __call__(self, *inputs, **kwargs):
        """Forward through the module (DDP-wrapped at stage 0); in training mode this micro-batch
        belongs to the open optimizer step."""
        engine = self.engine
        if engine.pipeline is not None:
            raise RuntimeError("engine(inputs) with parallel.pipeline: the schedule runs forward and backward "
                               "together; call engine.train_batch(data_iter=...) instead")
        inputs = tuple(t.to(engine.device) if torch.is_tensor(t) else t for t in inputs)
        forward = engine.ddp if engine.ddp is not None else engine.model
        if not engine.model.training:  # evaluation: nothing of a step
            return forward(*inputs, **kwargs)
        if self._window is None:
            self._open_step(inputs)
        rows = inputs[0].shape[0]
        # counter dropout: this step and the micro-batch's first row in the global batch (as train_batch)
        set_dropout_clock(engine.model, step=engine.step, row0=(engine.dp_rank * self.gradient_accumulation_steps()
                                                               + self._in_step) * rows)
        with comm.record(engine.comm_ledger), engine.profiler.phase("forward"):
            return forward(*inputs, **kwargs)

    forward = __call__

    # --8<-- [start:loop]
    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of loss / gradient_accumulation_steps (times the loss scale under fp16); the
        gradients are averaged over the data-parallel ranks by the boundary's backward (stages 0
        and 1; stage 2: every backward, stage 3: its hooks). Returns the scaled loss, as DeepSpeed does."""
        if not scale_wrt_gas:
            raise ValueError("backward(scale_wrt_gas=False) is refused: the engine's step averages micro-batch "
                             "gradients (loss / gradient_accumulation_steps), as train_batch does")
        if self._window is None:
            raise RuntimeError("backward() before a forward in training mode: call engine.train() and engine(inputs)")
        engine = self.engine
        gas = self.gradient_accumulation_steps()
        last = self.is_gradient_accumulation_boundary()
        sync = contextlib.nullcontext() if last else engine.accumulate_only()
        with comm.record(engine.comm_ledger), sync, engine.profiler.phase("backward"):
            # the expression of train_batch's loop, so float64 results match it bit for bit
            engine._scaled(loss * engine.cp_size / gas).backward(retain_graph=retain_graph)
        self._total += loss.detach().double()
        return loss / gas

    def step(self, lr_kwargs=None) -> None:
        """At an accumulation boundary: finish the optimizer step (agree, clip, step); else count the micro-batch."""
        if lr_kwargs is not None:
            raise ValueError("step(lr_kwargs=...) is refused: the config's scheduler section sets every step's lr")
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            self._in_step += 1
            return
        if self._window is None:
            raise RuntimeError("step() at an accumulation boundary with no forward/backward since the last step")
        engine = self.engine
        gas = self.gradient_accumulation_steps()
        try:
            parallelize.skip_dropout_masks(engine.model, engine.plan, [self._first_micro] * gas,
                                           engine.dp_size - 1 - engine.dp_rank)  # exact TP dropout
            with comm.record(engine.comm_ledger):
                total, failed, used, error = engine._agree_step(self._total, None)
            mean_loss, skipped = engine._finish_step(total, failed, used, gas, error, self._rng, self._hooked)
            self._window.close()  # the profiler's step ends after the optimizer's phase
            shape = (engine.batch.train_batch_size, *self._first_micro[0].shape[1:])
            engine._after_step((torch.empty(shape, device="meta"),), self._start, mean_loss, skipped)
        finally:
            self._reset()
        self.micro_steps += 1
    # --8<-- [end:loop]

    def _open_step(self, inputs: tuple) -> None:
        engine = self.engine
        if engine._broken is not None:
            raise RuntimeError(f"engine(inputs): this engine cannot continue: {engine._broken}; start a new "
                               "engine from the last checkpoint")
        self._start = engine._clock()
        if engine.zero is not None:
            engine.zero.abandon_backward()  # nothing to forget unless a caller ran backward itself
        # a dropped step must not have drawn random numbers (dropout): its draws are undone
        self._rng = (torch.random.get_rng_state(),
                     torch.cuda.get_rng_state() if engine.device.type == "cuda" else None,
                     parallelize.rng_state(engine.model))
        self._hooked = compression.snapshot(engine.ddp)
        self._total = torch.zeros((), dtype=torch.float64, device=engine.device)
        self._first_micro = tuple(t for t in inputs if torch.is_tensor(t))
        self._window = contextlib.ExitStack()
        self._window.enter_context(engine.profiler.step())
        gas = self.gradient_accumulation_steps()  # exact TP dropout: the earlier dp ranks' masks
        parallelize.skip_dropout_masks(engine.model, engine.plan, [self._first_micro] * gas, engine.dp_rank)

    def _reset(self) -> None:
        if self._window is not None:
            self._window.close()
        self._window, self._total, self._rng, self._hooked, self._in_step = None, None, None, None, 0

    # -- pipelines ------------------------------------------------------------------------------
    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One optimizer step over `gradient_accumulation_steps` micro-batches from `data_iter`
        (DeepSpeed's PipelineEngine.train_batch): each rank draws its own, the data-parallel
        ranks' are gathered into the global batch in `train_batch`'s order (rank-major), and
        the engine runs it (the pipeline schedule, if any). Returns the mean loss as a tensor."""
        if data_iter is None:
            raise ValueError("train_batch(data_iter=None): pass an iterator of micro-batches, e.g. "
                             "iter(training_dataloader) (tinyscale builds no loader of its own here)")
        if self._window is not None:
            raise RuntimeError("train_batch() inside an open step of engine(...)/backward(): finish it with step()")
        engine = self.engine
        micro = [tuple(next(data_iter)) for _ in range(self.gradient_accumulation_steps())]
        local = tuple(torch.cat([m[k] for m in micro]) for k in range(len(micro[0])))
        if engine.dp_size > 1:  # rank-major: dp rank r's rows are block r of the global batch
            group = engine.mesh.group("dp")
            blocks = [[torch.empty_like(t) for _ in range(engine.dp_size)] for t in local]
            for out, t in zip(blocks, local):
                dist.all_gather(out, t.contiguous(), group=group)
            local = tuple(torch.cat(out) for out in blocks)
        loss = engine.train_batch(local)
        self.micro_steps += self.gradient_accumulation_steps()
        return torch.tensor(loss, dtype=torch.float64)  # exact: the engine's mean is a Python float

    # -- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state: dict | None = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """Write save_dir/tag (default tag ``global_step{N}``) with `client_state`, then the
        ``latest`` file naming the tag (rank 0), as DeepSpeed does. Call on every rank."""
        if exclude_frozen_parameters:
            raise ValueError("save_checkpoint(exclude_frozen_parameters=True) is refused: the checkpoint holds "
                             "the whole model, frozen parameters included")
        if self._window is not None:
            raise RuntimeError("save_checkpoint inside an open step: the gradients accumulated so far are not "
                               "saved; save after the boundary's step()")
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty path, got {save_dir!r}")
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        self.engine.save_checkpoint(Path(save_dir) / tag, client_state=dict(client_state or {}))
        if save_latest and self.global_rank == 0:  # after the checkpoint is whole, atomically
            tmp = Path(save_dir) / "latest.tmp"
            tmp.write_text(tag)
            os.replace(tmp, Path(save_dir) / "latest")
        if dist.is_initialized():
            dist.barrier()  # no rank reads `latest` before rank 0 wrote it
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn=None) -> tuple[str | None, dict | None]:
        """(path, client_state) from load_dir/tag (default: the tag in ``latest``); (None, None)
        with a warning if there is no ``latest`` file, as DeepSpeed. `path` is the tag's
        directory (DeepSpeed returns its model-states file inside it)."""
        partial = {"load_module_strict": (load_module_strict, True),
                   "load_optimizer_states": (load_optimizer_states, True),
                   "load_lr_scheduler_states": (load_lr_scheduler_states, True),
                   "load_module_only": (load_module_only, False), "custom_load_fn": (custom_load_fn, None)}
        for name, (value, served) in partial.items():
            if value is not served and value != served:
                raise ValueError(f"load_checkpoint({name}={value!r}) is refused: a checkpoint resumes whole "
                                 "(parameters, optimizer, schedule, random state); for the weights alone load "
                                 "engine.module.load_state_dict from your own file")
        if tag is None:
            latest = Path(load_dir) / "latest"
            if not latest.is_file():
                if self.global_rank == 0:
                    get_logger("tinyscale.checkpoint").warning(
                        "load_checkpoint: no 'latest' file in %s; pass tag= to load a checkpoint", load_dir)
                return None, None
            tag = latest.read_text().strip()
        self._reset()
        path = Path(load_dir) / str(tag)
        client_state = self.engine.load_checkpoint(path)
        self.micro_steps = self.global_steps * self.gradient_accumulation_steps()
        return str(path), client_state
