"""Changing the batch size between steps: DeepSpeed's `set_train_batch_size` and
`set_train_micro_batch_size`, and a batch ramp-up (config ``rampup_batch_size``, Megatron's
``--rampup-batch-size start increment samples``; DeepSpeed 0.19.8 has no such key).

    engine.set_train_batch_size(16)                      # accumulation follows: 16 / (micro x dp)
    engine.set_train_batch_size(16, lr_scaling="sqrt")   # and the lr: x sqrt(16 / the config's batch)
    engine.set_train_micro_batch_size(4)                 # accumulation kept: the batch follows

Why the math stays one process's: a step backpropagates ``loss_i / accumulation`` for each of a
rank's micro-batches and averages over dp, so the gradient is the mean over the global batch
whatever its cut (micro x accumulation x dp). A new batch size changes the rows of the next
step and nothing else: the optimizer state, the step count (the lr schedule counts applied
steps), the fp16 loss scale and the parameters are untouched, and the engine equals
`tinyscale.reference.train` fed the same batches (``pytest -k batch_change``).

What does not follow by itself is the learning rate (DeepSpeed's call does not touch it). A
larger batch has a less noisy gradient; the linear rule (Goyal et al. 2017: k times the batch,
k times the lr) keeps the progress per sample of SGD, the square-root rule (Krizhevsky 2014;
Adam's noise scale, Malladi et al. 2022) keeps the update's noise. ``lr_scaling`` "linear" or
"sqrt" sets the lr to the config's (or the schedule's) times r or sqrt(r), r = the new batch /
the config's batch; None (the default) leaves it. Lesson 12 measures both. A checkpoint keeps
the samples trained, not a batch set by a call: an engine that loads it starts at its own
config's batch and lr (or the ramp's), so call again after `load_checkpoint` to keep a change.

Every rank must apply the same change: a rank with another accumulation count would run more
backward passes than its peers and wait in a collective they never make, or step with a
different gradient scale. The calls are collective: the requested values are all-gathered over
the world and every rank raises if any differs. The ramp-up needs no message: its batch is a
function of the samples trained, the same number on every rank (and saved in checkpoints).

Refused, with why: a batch that is not a multiple of micro x dp (DeepSpeed's ValueError); under
``parallel.pipeline`` (its schedule, with every send and receive, is lowered at initialize for
``gradient_accumulation_steps`` micro-batches: change it through a checkpoint, which loads
under another batch and layout); inside an open step of the DeepSpeed loop (its micro-batches
were scaled by 1 / the old accumulation).
"""

from __future__ import annotations

import math

import torch.distributed as dist

from tinyscale.config import BatchLayout, ConfigError

LR_RULES = {None: lambda r: 1.0, "linear": lambda r: r, "sqrt": math.sqrt}


def _check_layout(engine, what: str) -> None:
    if engine.plan.pp > 1:
        raise ConfigError(f"{what} with parallel.pipeline={engine.plan.pp}: the pipeline's schedule is lowered at "
                          "initialize for gradient_accumulation_steps micro-batches (every send and receive "
                          "planned); save a checkpoint and load it into an engine built with the new batch "
                          "(checkpoints load across batch sizes and layouts)")


# --8<-- [start:agree]
def _agree(values: tuple, what: str) -> None:
    """Every rank asked for the same change, or every rank raises (no rank steps alone)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    said = [None] * dist.get_world_size()
    dist.all_gather_object(said, values)
    if any(s != said[0] for s in said):
        raise ValueError(f"{what}: the ranks asked for different changes {dict(enumerate(said))}; every rank "
                         "must apply the same batch and lr (decide on all-reduced values, or on rank 0 and "
                         "broadcast)")


def apply(engine, new: BatchLayout, lr_scaling: str | None, what: str) -> None:
    """Set `engine`'s batch to `new` on every rank (collective), the lr scaled by `lr_scaling`."""
    if lr_scaling not in LR_RULES:
        raise ValueError(f"{what}: lr_scaling must be None, 'linear' or 'sqrt', got {lr_scaling!r}")
    _check_layout(engine, what)
    _agree((new.train_batch_size, new.micro_batch_size, lr_scaling), what)
    scale = LR_RULES[lr_scaling](new.train_batch_size / engine.config_batch_size)
    if not engine._schedules_lr:  # a caller's optimizer keeps its own lr: scale that
        for group in engine._torch_optimizer().param_groups:
            group["lr"] *= scale / engine.lr_scale
    engine.batch, engine.lr_scale = new, scale
# --8<-- [end:agree]


def with_train_batch_size(batch: BatchLayout, train_batch_size: int) -> BatchLayout:
    """DeepSpeed's rule: micro and dp kept, accumulation = train_batch_size / (micro x dp)."""
    unit = batch.micro_batch_size * batch.dp
    if not isinstance(train_batch_size, int) or train_batch_size <= 0 or train_batch_size % unit:
        raise ValueError(f"set_train_batch_size({train_batch_size!r}): the batch must be a positive multiple of "
                         f"train_micro_batch_size_per_gpu x data-parallel size = {batch.micro_batch_size} x "
                         f"{batch.dp} = {unit} (DeepSpeed's: 'Train batch size must be divisible by micro-batch "
                         "data parallelism')")
    return BatchLayout(train_batch_size, batch.micro_batch_size, train_batch_size // unit, batch.dp)


def with_micro_batch_size(batch: BatchLayout, micro_batch_size: int) -> BatchLayout:
    """DeepSpeed's rule: accumulation and dp kept, the batch = micro x accumulation x dp."""
    if not isinstance(micro_batch_size, int) or micro_batch_size <= 0:
        raise ValueError(f"set_train_micro_batch_size({micro_batch_size!r}): a positive number of rows")
    accum = batch.gradient_accumulation_steps
    return BatchLayout(micro_batch_size * accum * batch.dp, micro_batch_size, accum, batch.dp)


# --- the ramp-up -----------------------------------------------------------------------------------

# --8<-- [start:rampup]
def rampup_batch_size(start: int, increment: int, samples: int, final: int, consumed: int) -> int:
    """Megatron's ramp-up: the batch grows from `start` by `increment` in (final - start) /
    increment equal slices of `samples` trained samples, then stays at `final`."""
    if consumed > samples or final == start:
        return final
    per_increment = samples / ((final - start) // increment)
    return min(final, start + int(consumed / per_increment) * increment)
# --8<-- [end:rampup]


def check_rampup(engine) -> None:
    """At initialize: every batch of the ramp must be a multiple of micro x dp, the ramp must reach
    the config's batch in whole increments, and a pipeline's schedule cannot follow it."""
    ramp = engine.config.rampup_batch_size
    if ramp is None:
        return
    final, unit = engine.config_batch_size, engine.batch.micro_batch_size * engine.dp_size
    problems = []
    if ramp.start > final or (final - ramp.start) % ramp.increment:
        problems.append(f"rampup_batch_size: start {ramp.start} must reach train_batch_size {final} in whole "
                        f"increments of {ramp.increment} (final - start a multiple of increment, start <= final)")
    if ramp.start % unit or ramp.increment % unit:
        problems.append(f"rampup_batch_size: start {ramp.start} and increment {ramp.increment} must be multiples of "
                        f"train_micro_batch_size_per_gpu x data-parallel size = {unit}, so that every batch of the "
                        "ramp is whole micro-batches on every rank")
    if problems:
        raise ConfigError("\n  ".join(problems))
    _check_layout(engine, "rampup_batch_size")


def follow_rampup(engine) -> None:
    """Before a step (after initialize, each step and a load): the ramp's batch for the samples
    trained. The same on every rank by construction: nothing to agree."""
    ramp = engine.config.rampup_batch_size
    if ramp is None:
        return
    size = rampup_batch_size(ramp.start, ramp.increment, ramp.samples, engine.config_batch_size, engine.samples)
    if size != engine.batch.train_batch_size:
        engine.batch = with_train_batch_size(engine.batch, size)
