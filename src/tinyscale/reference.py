"""The single-process trainer: the truth every parallel topic is compared with.

    losses = ts.reference.train(model, batches, config)

Plain PyTorch, no process group. For each global batch (a tuple of tensors whose dim 0 is
`train_batch_size` rows) it takes exactly one optimizer step on the gradient of the mean
loss over the whole batch:

1. cut the batch into micro-batches of ``train_micro_batch_size_per_gpu`` rows (only to
   bound memory: all of them are summed before the step, so the cut does not change the
   math; float64 makes the different summation order invisible); a GPT with counter dropout
   masks is told the step and each micro-batch's first global row
   (`tinyscale.models.dropout.set_dropout_clock`), so its masks are those of every layout;
2. backward ``loss_i / num_micro_batches`` for each: the model's loss is a mean over its
   rows and every micro-batch has the same number of rows, so the accumulated gradient is
   the gradient of the mean over the global batch;
3. clip the global gradient norm to ``gradient_clipping`` (if set), set the learning rate
   of this step (`tinyscale.optim.lr_at`), step, zero the gradients.

It returns the per-step mean losses and leaves the trained parameters in `model`.
Parallelism-only config (ZeRO stage, parallel degrees) is ignored: the math is the same.

With ``fp16`` or ``bf16`` enabled it trains as the engine does in one process
(`tinyscale.precision.MixedPrecisionOptimizer`): the model computes in that format, fp32
masters and states step; fp16 backpropagates loss x S, and an overflowing step is skipped
(the scale backs off; the learning-rate schedule does not advance). Clipping then runs on the
masters' unscaled gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch

from tinyscale.config import EngineConfig
from tinyscale.data import micro_batches
from tinyscale.models.dropout import set_dropout_clock
from tinyscale.optim import OptimizerFactory, lr_at, optimizer_factory, schedule_base_lr, set_lr
from tinyscale.precision import MixedPrecisionOptimizer, make_loss_scaler

Batch = Sequence[torch.Tensor]


def _micro_batch_size(config: EngineConfig, rows: int) -> int:
    if config.train_batch_size is not None and rows != config.train_batch_size:
        raise ValueError(
            f"a batch has {rows} rows but train_batch_size is {config.train_batch_size}; "
            "every global batch must have exactly train_batch_size rows"
        )
    micro = config.train_micro_batch_size_per_gpu
    if micro is None:  # only the global size is known: one micro-batch per accumulation step
        micro = rows // (config.gradient_accumulation_steps or 1)
    return micro


# --8<-- [start:train-step]
def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch,
               config: EngineConfig, step: int, schedule_lr: bool = True, base_lr: float | None = None) -> float:
    """One optimizer step on one global batch; returns its mean loss (`base_lr`: the lr the
    config's scheduler scales, `tinyscale.optim.schedule_base_lr`; default the config's)."""
    device = next(model.parameters()).device
    batch = tuple(t.to(device) for t in batch)
    micro = _micro_batch_size(config, batch[0].shape[0])
    chunks = micro_batches(batch, micro)
    total = torch.zeros((), dtype=torch.float64, device=device)
    mixed = isinstance(optimizer, MixedPrecisionOptimizer)  # fp16/bf16: see `mixed_precision_step`
    for i, chunk in enumerate(chunks):
        set_dropout_clock(model, step=step, row0=i * micro)  # counter dropout: this step, these global rows
        loss = model(*chunk)
        if mixed:
            optimizer.backward(loss / len(chunks))  # (loss_i / n) x S under fp16
        else:
            (loss / len(chunks)).backward()
        total += loss.detach().double()
    mean_loss = (total / len(chunks)).item()
    if mixed:
        mixed_precision_step(optimizer, config, step, schedule_lr, base_lr)
        return mean_loss
    if not math.isfinite(mean_loss):
        raise FloatingPointError(f"reference: the loss at step {step} is {mean_loss}; training diverged")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if config.gradient_clipping > 0:
        torch.nn.utils.clip_grad_norm_(params, config.gradient_clipping)
    if schedule_lr:  # False: a caller's own optimizer with no config scheduler keeps its lr
        set_lr(optimizer, lr_at(step, config, base_lr))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return mean_loss
# --8<-- [end:train-step]


def mixed_precision_step(optimizer: MixedPrecisionOptimizer, config: EngineConfig, step: int,
                         schedule_lr: bool, base_lr: float | None = None) -> bool:
    """fp16/bf16's step, as the engine takes it: overflow check, unscale, clip and step on the
    fp32 masters; a skipped step (True) does not advance the learning-rate schedule."""
    if schedule_lr:
        skipped = optimizer.loss_scaler.overflows if optimizer.loss_scaler is not None else 0
        set_lr(optimizer, lr_at(step - skipped, config, base_lr))
    skipped_now = optimizer.step(max_norm=config.gradient_clipping)
    optimizer.zero_grad(set_to_none=True)
    return skipped_now


def train(model: torch.nn.Module, batches: Iterable[Batch], config,
          on_step: Callable[[int, float], None] | None = None,
          param_groups: Callable[[torch.nn.Module], list[dict]] | None = None,
          optimizer: OptimizerFactory | None = None) -> list[float]:
    """Train `model` in this process on each global batch in turn; return the per-step losses.

    `config` is a dict, a path to a .json/.yaml file, or an `EngineConfig`; `on_step(step,
    loss)` is called after every step (progress bars use it); `param_groups(model)` may
    return torch-style parameter groups with their own hyperparameters; `optimizer` is a
    caller's own optimizer, as `ts.initialize` takes it (`tinyscale.optim.optimizer_factory`).
    """
    config = EngineConfig.load(config)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("reference.train: the model has no parameter that requires grad")
    schedule_lr = optimizer is None or config.scheduler is not None
    make = optimizer_factory(config, optimizer)
    groups = param_groups(model) if param_groups is not None else params
    if config.fp16.enabled or config.bf16.enabled:  # the masters are taken before the model is rounded
        scaler = make_loss_scaler(**config.fp16.model_dump(exclude={"enabled"})) if config.fp16.enabled else None
        dtype = torch.float16 if config.fp16.enabled else torch.bfloat16
        optimizer = MixedPrecisionOptimizer(groups, make, dtype=dtype, loss_scaler=scaler)
    else:
        optimizer = make(groups)
    inner = optimizer.optimizer if isinstance(optimizer, MixedPrecisionOptimizer) else optimizer
    base_lr = schedule_base_lr(inner, config) if schedule_lr else None  # a caller's optimizer: its own lr
    model.train()
    losses = []
    for step, batch in enumerate(batches):
        losses.append(train_step(model, optimizer, batch, config, step, schedule_lr, base_lr))
        if on_step is not None:
            on_step(step, losses[-1])
    return losses
