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

A step dropped after its hooks ran gets the hook's state put back (`snapshot`, `restore`); a
checkpoint holds every rank's compression state (`local_state`) and resumes it on as many ranks.

Lesson: lessons/10-compression.md. Tests: `pytest -k compression_engine`, `pytest -k compression_user`.
"""

from __future__ import annotations

import torch

from tinyscale.compression import (
    QSGD, CompressionState, OneBitAdam, PowerSGDState, RandomK, TopK, compression_hook, powersgd_hook,
)
from tinyscale.config import EngineConfig
from tinyscale.engine.checkpoint import CheckpointError


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


def _hook_state(ddp):
    hook = getattr(ddp, "_comm_hook", None)
    return hook[0] if hook is not None and isinstance(hook[0], (CompressionState, PowerSGDState)) else None


def snapshot(ddp):
    """The hook's state before a step (None without one): a step that is dropped has run the
    hooks (every rank completes the buckets' communication), so it must be put back."""
    state = _hook_state(ddp)
    return None if state is None else state.state_dict()


def restore(ddp, saved) -> None:
    """Put back what `snapshot` took."""
    if saved is not None:
        _hook_state(ddp).load_state_dict(saved)


def keep_unsent(ddp, saved) -> None:
    """Error feedback: a parameter no rank used this step gets no gradient (DDP drops its
    average), so what the hook sent of its residual would be lost: it keeps the residual it had
    (PowerSGD: its slice of the bucket's error)."""
    state = _hook_state(ddp)
    if isinstance(state, PowerSGDState) and state.use_error_feedback:  # errors per bucket: their slices
        for b, bucket in enumerate(ddp.buckets):
            if b not in state.errors or state.errors[b] is saved["errors"].get(b):
                continue  # no memory yet, or not compressed this step
            old = saved["errors"].get(b)
            for i, p in enumerate(bucket.params):
                if p.grad is None:
                    where = slice(bucket.offsets[i], bucket.offsets[i] + p.numel())
                    state.errors[b][where] = 0 if old is None else old[where]
        return
    if not isinstance(state, CompressionState) or state.feedback is None:
        return
    for p in ddp.params:
        if p.grad is None and p in saved["residuals"]:
            state.residuals[p] = saved["residuals"][p]
        elif p.grad is None:
            state.residuals.pop(p, None)


def local_state(engine) -> dict | None:
    """This rank's compression state for a checkpoint (residuals by parameter name), or None.
    Per rank: each rank's residuals and errors differ, so rank 0 saves every rank's."""
    names = {p: n for n, p in engine.model.named_parameters()}
    if isinstance(engine.optimizer, OneBitAdam):
        return {"type": "onebit_adam", "state": engine.optimizer.comm_state()}
    state = snapshot(engine.ddp)
    if state is None:
        return None
    if "residuals" in state:
        state["residuals"] = {names[p]: r.clone() for p, r in state["residuals"].items()}
    return {"type": engine.config.compression.type, "state": state}


def check_resume(saved_world: int, world: int, saved_ranks: dict) -> None:
    """Refuse a resume on another world size when the checkpoint holds compression state
    (residuals and errors are per rank, 1-bit Adam's server error per rank's chunk)."""
    if saved_world != world and any(s.get("compression") for s in saved_ranks.values()):
        raise CheckpointError(f"load_checkpoint: the checkpoint holds per-rank compression state (residuals, "
                              f"errors) of {saved_world} ranks and is loaded on {world}: resume on {saved_world} "
                              "ranks, or load it into an engine with compression.type \"none\"")


def load_local_state(engine, saved: dict | None) -> None:
    """Set this rank's compression state from `local_state`'s (None: the checkpoint has none,
    as from a run without compression: start it fresh)."""
    if saved is None or saved["type"] != engine.config.compression.type:
        return  # none saved, or another compressor's: this one starts fresh
    device, state = engine.device, dict(saved["state"])
    if isinstance(engine.optimizer, OneBitAdam):
        engine.optimizer.load_comm_state({k: v.to(device) if isinstance(v, torch.Tensor) else v
                                          for k, v in state.items()})
        return
    if "residuals" in state:
        params = dict(engine.model.named_parameters())
        state["residuals"] = {params[n]: r.to(device) for n, r in state["residuals"].items()}
    if "errors" in state:  # PowerSGD's memories (its seed stream stays on the CPU)
        sizes = [b.offsets[-1] + b.params[-1].numel() for b in engine.ddp.buckets]
        if any(i >= len(sizes) or e.numel() != sizes[i] for i, e in state["errors"].items()):
            raise CheckpointError("load_checkpoint: PowerSGD's memories are per bucket, and this engine's buckets "
                                  "differ from the checkpoint's: resume with the zero_optimization.reduce_bucket_size "
                                  "(and model) it was saved with")
        state["errors"] = {i: e.to(device) for i, e in state["errors"].items()}
        state["qs"] = {i: [q.to(device) for q in qs] for i, qs in state["qs"].items()}
    restore(engine.ddp, state)
