"""The `compression` section in the engine: which hook or optimizer, and what it composes with.

    "compression": {"type": "powersgd", "rank": 2}

topk, randomk, qsgd and powersgd replace the all-reduce of each `BucketedDDP` bucket with
a communication hook (`tinyscale.compression`); onebit_adam replaces the optimizer, which
then does the data-parallel communication itself (no DDP wrapper: in its warm-up it
all-reduces the gradients, after it the 1-bit momentum).

What is refused, and why (before any process group exists):
- ZeRO stages 1-3: they reduce-scatter gradients into shards (or all-gather parameters); a
  compressed payload is not a sum that can be scattered (top-k's indices differ per rank,
  PowerSGD's P and Q are not gradients). Compression here is for data parallelism (stage 0).
- tensor, pipeline, context parallelism, fp16/bf16: not tested together yet.
- onebit_adam with gradient clipping (after the warm-up no rank holds the averaged gradient
  to take a norm of) or with an optimizer other than Adam/AdamW. Gradient accumulation is
  fine: gradients accumulate locally, as under DDP's no_sync, and the optimizer step
  communicates once.
- powersgd with start_iter 1: its per-bucket memories need one plain step first (torch
  refuses the same).

Lesson: lessons/10-compression.md. Tests: `pytest -k compression_engine`.
"""

from __future__ import annotations

import torch

from tinyscale.compression import (
    QSGD, CompressionState, OneBitAdam, PowerSGDState, RandomK, TopK, compression_hook, powersgd_hook,
)
from tinyscale.config import EngineConfig


def check_config(config: EngineConfig) -> list[str]:
    """What this config asks of compression that the engine cannot serve (no model needed)."""
    c, problems = config.compression, []
    if c.type == "none":
        return problems
    stage = config.zero_optimization.stage
    if stage > 0:
        problems.append(f"compression.type={c.type!r} with zero_optimization.stage={stage}: ZeRO reduce-scatters "
                        "gradients into shards and a compressed payload is not a sum that can be scattered; use "
                        "stage 0 (data parallelism) with compression, or compression.type \"none\"")
    par = config.parallel
    for name in ("tensor", "pipeline", "context"):
        if getattr(par, name) > 1:
            problems.append(f"compression.type={c.type!r} with parallel.{name}={getattr(par, name)} (not tested "
                            "together yet): use one of them")
    for section in ("fp16", "bf16"):
        if getattr(config, section).enabled:
            problems.append(f"compression.type={c.type!r} with {section}.enabled (not tested together yet)")
    if c.type == "powersgd" and c.start_iter < 2:
        problems.append(f"compression.start_iter={c.start_iter} with type \"powersgd\": error feedback and warm "
                        "start need at least one plain all-reduce step first; set start_iter >= 2")
    if c.type == "onebit_adam":
        if config.optimizer.type not in ("Adam", "AdamW"):
            problems.append(f"compression.type=\"onebit_adam\" replaces the optimizer: optimizer.type is "
                            f"{config.optimizer.type!r}; set optimizer.type \"AdamW\" (its params are used)")
        if config.gradient_clipping > 0:
            problems.append("compression.type=\"onebit_adam\" with gradient_clipping: after the warm-up no rank "
                            "holds the averaged gradient to take a norm of; set gradient_clipping 0")
    return problems


def owns_communication(config: EngineConfig) -> bool:
    """True when the optimizer does the data-parallel communication (no DDP wrapper)."""
    return config.compression.type == "onebit_adam"


def optimizer(groups, config: EngineConfig, group) -> torch.optim.Optimizer:
    """1-bit Adam over `groups` with the config's optimizer params (AdamW's decoupled decay)."""
    p = config.optimizer.params
    return OneBitAdam(groups, lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay,
                      freeze_step=config.compression.freeze_step, group=group)


# --8<-- [start:attach]
def attach(ddp, config: EngineConfig, group) -> None:
    """Register the configured compression hook on the engine's `BucketedDDP`."""
    c = config.compression
    if c.type == "powersgd":
        state = PowerSGDState(group, matrix_approximation_rank=c.rank, start_powerSGD_iter=c.start_iter,
                              min_compression_rate=c.min_compression_rate, use_error_feedback=c.error_feedback,
                              random_seed=c.seed)
        ddp.register_comm_hook(state, powersgd_hook)
    elif c.type in ("topk", "randomk", "qsgd"):
        compressor = {"topk": lambda: TopK(c.ratio), "randomk": lambda: RandomK(c.ratio, seed=c.seed),
                      "qsgd": lambda: QSGD(c.bits, seed=c.seed)}[c.type]()
        ddp.register_comm_hook(CompressionState(compressor, group, error_feedback=c.error_feedback), compression_hook)
# --8<-- [end:attach]
