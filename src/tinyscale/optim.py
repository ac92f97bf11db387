"""Optimizer and learning-rate schedule from an `EngineConfig`, shared by the reference and the engine.

Both build their optimizer here so that "the engine trains exactly like one process" is
a statement about parallelism, never about two slightly different optimizers.

The schedule is a pure function of the step: `lr_at(step, config)` is the learning rate
used by the `step`-th applied optimizer step (0-based; a skipped fp16 step does not count), and
it is DeepSpeed's, value for value (`pytest -k deepspeed_agreement` runs DeepSpeed 0.19.8's own
schedulers beside it). DeepSpeed sets the lr once when it builds the scheduler and steps the
scheduler after each applied optimizer step, so step `step` runs at the formula's value for
i = step - 1, and step 0 at i = -1: warmup_min_lr (WarmupLR, WarmupDecayLR) or 0 (WarmupCosineLR,
whatever its warmup_min_ratio). With W = max(2, warmup_num_steps) (DeepSpeed clamps it) and
lr_min, lr_max = warmup_min_lr, warmup_max_lr (WarmupLR's warmup_max_lr defaults to the
optimizer's lr, WarmupDecayLR's to 0.001):

    linear warm-up   g = i / W                                             (0 <= i < W)
    log warm-up      g = log(i + 1) / log(W)
    WarmupLR         g = 1                                                 (i >= W)
    WarmupDecayLR    g = max(0, (T - i) / max(1, T - W))
    lr = lr_min + (lr_max - lr_min) * g
    WarmupCosineLR   lr = lr0 * (r + (1 - r) * g) in warm-up (r = warmup_min_ratio, lr0 the optimizer's lr),
                     then lr0 * max(0, c + (1 - c) * (1 + cos(pi * p)) / 2), p = min(1, (i - W + 1) / max(1, T - W))

(T = total_num_steps, c = cos_min_ratio). Two consequences a reader may not expect, both
DeepSpeed's: the first two steps both run at lr_min (i = -1 and i = 0 give g = 0), so with the
default warmup_min_lr 0 the first two steps do not move the parameters; and warmup_num_steps 1
warms up over 2 steps. docs/deepspeed-config.md lists them. The arithmetic is written in
DeepSpeed's order, so the values are equal, not just close.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from tinyscale.config import ConfigError, EngineConfig, OptimizerConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
    """The configured torch optimizer over `params` (a list of tensors or of param-group dicts)."""
    p = config.params
    params = list(params)
    if config.type == "AdamW":
        return torch.optim.AdamW(params, lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay)
    if config.type == "Adam" and p.adam_w_mode and p.weight_decay:  # DeepSpeed's Adam: decoupled decay
        return torch.optim.AdamW(params, lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay)
    if config.type == "Adam":
        return torch.optim.Adam(params, lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay)
    return torch.optim.SGD(params, lr=p.lr, momentum=p.momentum, nesterov=p.nesterov, weight_decay=p.weight_decay)


def lr_at(step: int, config: EngineConfig, base: float | None = None) -> float:
    """Learning rate of the `step`-th applied optimizer step (0-based), as DeepSpeed gives it.
    `base`: the optimizer's own lr (`schedule_base_lr`), which DeepSpeed's schedulers read from
    the optimizer they wrap (WarmupLR's default peak, WarmupCosineLR's scale); default the config's."""
    base = config.optimizer.params.lr if base is None else base
    sched = config.scheduler
    if sched is None:
        return base
    p = sched.params
    i = step - 1  # DeepSpeed's last_batch_iteration: -1 when it builds the scheduler, +1 after each step
    warmup = max(2, p.warmup_num_steps)
    if i < 0:
        return 0.0 if sched.type == "WarmupCosineLR" else p.warmup_min_lr
    if i < warmup:
        gamma = (1.0 / math.log(warmup)) * math.log(i + 1) if p.warmup_type == "log" else i / warmup
    if sched.type == "WarmupCosineLR":
        if i < warmup:
            ratio = p.warmup_min_ratio + gamma * (1.0 - p.warmup_min_ratio)
        else:
            progress = min(1.0, (i - warmup + 1) / max(1, p.total_num_steps - warmup))
            c = p.cos_min_ratio
            ratio = max(0.0, c + (1.0 - c) * ((1 + math.cos(math.pi * progress)) / 2))
        return base * ratio
    low = p.warmup_min_lr
    peak = base if p.warmup_max_lr is None else p.warmup_max_lr  # WarmupLR's default: the optimizer's lr
    if i >= warmup:
        gamma = 1.0 if sched.type == "WarmupLR" else max(
            0.0, float(p.total_num_steps - i) / float(max(1.0, p.total_num_steps - warmup)))
    return low + (peak - low) * gamma


def schedule_base_lr(optimizer: torch.optim.Optimizer, config: EngineConfig) -> float | None:
    """The lr a config's scheduler scales: the one every parameter group of `optimizer` starts
    with (a caller's optimizer may have its own, not the config's). None without a scheduler.
    Groups with different lrs are refused: DeepSpeed scales each group's own, one schedule here."""
    if config.scheduler is None:
        return None
    lrs = sorted({group["lr"] for group in optimizer.param_groups})
    if len(lrs) > 1:
        raise ConfigError(
            f"scheduler: the optimizer's parameter groups start at different learning rates {lrs}, and "
            "tinyscale's schedule sets one lr for every group; give the groups one lr, or remove the "
            "config's scheduler section and keep the optimizer's own lrs")
    return lrs[0]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


# --8<-- [start:custom-optimizer]
OptimizerFactory = Callable[[list], torch.optim.Optimizer]


def optimizer_factory(config: EngineConfig, optimizer: OptimizerFactory | None = None) -> OptimizerFactory:
    """What builds the optimizer over a list of parameter groups: the config's `optimizer`
    section, or the caller's own (`ts.initialize(..., optimizer=...)`): a `torch.optim.Optimizer`
    subclass (built with its defaults) or any callable `groups -> Optimizer` (e.g.
    `functools.partial(Lion, lr=3e-4)`). The engine calls it once per rank; under ZeRO over
    this rank's flat pieces of the parameters, under mixed precision over fp32 masters.

    The contract a custom optimizer keeps (torch's own optimizers all do):
    - it steps only parameters whose `.grad` is not None (a parameter no rank used is skipped);
    - `param_groups[i]["lr"]` is its learning rate, read at every step (a config `scheduler`
      writes it before each step);
    - its state lives in `optimizer.state[param]` (checkpoints save it by parameter name);
    - under ZeRO stages 1-3 its update is elementwise: an element's new value depends only on
      that element's gradient, state and the group's hyperparameters, because each rank
      steps 1-D pieces of parameters. SGD, Adam(W), Lion, Adagrad and RMSprop are; LAMB and
      LARS (a trust ratio from the whole tensor's norm), Adafactor (factored row/column
      moments), Shampoo and Muon (whole-matrix preconditioners) are not, and would silently
      compute something else on pieces. A state tensor not shaped like its piece is refused
      (`check_elementwise_state`); a per-tensor norm cannot be detected, so it is on you.
    """
    if optimizer is None:
        return lambda groups: build_optimizer(groups, config.optimizer)
    if "optimizer" in config.model_fields_set:
        raise ConfigError("config field 'optimizer' and initialize(optimizer=...) are both given: the "
                          "optimizer is built from one of them; remove the config's 'optimizer' section")
    if not callable(optimizer):
        raise TypeError(f"initialize(optimizer=...) takes a torch.optim.Optimizer subclass or a callable "
                        f"groups -> Optimizer, got {type(optimizer).__name__}")

    def make(groups: list) -> torch.optim.Optimizer:
        built = optimizer(groups)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"initialize(optimizer=...): {optimizer!r} returned {type(built).__name__}, "
                            "not a torch.optim.Optimizer")
        return built
    return make


def check_elementwise_state(optimizer: torch.optim.Optimizer) -> None:
    """Under ZeRO each state tensor must be shaped like the piece it belongs to (or be a
    0-d scalar such as Adam's `step`); anything else cannot be sharded, saved or resumed."""
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != p.shape:
                raise ValueError(
                    f"{type(optimizer).__name__} keeps state {key!r} of shape {tuple(value.shape)} for a parameter "
                    f"piece of shape {tuple(p.shape)}: ZeRO shards optimizer state elementwise, so it needs an "
                    "optimizer whose update is elementwise (see tinyscale.optim.optimizer_factory); use "
                    "zero_optimization.stage 0 for this optimizer")
# --8<-- [end:custom-optimizer]
