"""Optimizer and learning-rate schedule from an `EngineConfig`, shared by the reference and the engine.

Both build their optimizer here so that "the engine trains exactly like one process" is
a statement about parallelism, never about two slightly different optimizers.

The schedule is a pure function of the step: `lr_at(step, config)` is the learning rate
used by optimizer step `step` (0-based). With warm-up over W steps from lr_min to lr_max:

    linear warm-up   lr = lr_min + (lr_max - lr_min) * step / W            (step < W)
    log warm-up      lr = lr_min + (lr_max - lr_min) * log(step + 1) / log(W + 1)
    WarmupLR         lr = lr_max                                           (step >= W)
    WarmupDecayLR    lr = lr_max * (T - step) / (T - W), floored at 0      (step >= W)
    WarmupCosineLR   lr = lr_max * (c + (1 - c) * (1 + cos(pi * p)) / 2),  p = (step - W) / (T - W)

(T = total_num_steps, c = cos_min_ratio). The shapes follow DeepSpeed's schedulers of the
same names; the exact step indexing is ours and stated here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from tinyscale.config import EngineConfig, OptimizerConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
    """The configured torch optimizer over `params` (a list of tensors or of param-group dicts)."""
    p = config.params
    params = list(params)
    if config.type == "AdamW":
        return torch.optim.AdamW(params, lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay)
    if config.type == "Adam":
        return torch.optim.Adam(params, lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay)
    return torch.optim.SGD(params, lr=p.lr, momentum=p.momentum, nesterov=p.nesterov, weight_decay=p.weight_decay)


def lr_at(step: int, config: EngineConfig) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    base = config.optimizer.params.lr
    sched = config.scheduler
    if sched is None:
        return base
    p = sched.params
    peak = p.warmup_max_lr if p.warmup_max_lr is not None else base
    warmup = p.warmup_num_steps
    if step < warmup:
        if p.warmup_type == "linear":
            frac = step / warmup
        else:
            frac = math.log(step + 1) / math.log(warmup + 1)
        return p.warmup_min_lr + (peak - p.warmup_min_lr) * frac
    if sched.type == "WarmupLR":
        return peak
    total = p.total_num_steps
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if sched.type == "WarmupDecayLR":
        return peak * max(0.0, 1.0 - progress)
    c = p.cos_min_ratio
    return peak * (c + (1 - c) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
