"""`MixedPrecisionOptimizer`: fp16 or bf16 parameters for compute, fp32 master weights for the update.

Paper: Micikevicius et al., "Mixed Precision Training" (ICLR 2018), sec. 3.1 (fp32 master copy
of weights) and 3.2 (loss scaling); the byte count is ZeRO's (Rajbhandari et al. 2020, sec. 3.1):
2 + 2 + 12 = 16 bytes per parameter with Adam. Lesson: lessons/04-mixed-precision.md.
Tests: ``pytest -k mixed_precision``.

What each parameter costs (Psi parameters, Adam):

    model parameter   fp16/bf16   2 Psi   forward and backward read these
    its gradient      fp16/bf16   2 Psi   backward writes these (x S with a loss scaler)
    master weight     fp32        4 Psi   the optimizer updates these...
    exp_avg, exp_avg_sq  fp32     8 Psi   ...with states kept in fp32 too

One step (`step`): check the low-precision gradients for inf/nan (agreed across the process
group: every rank skips together), upcast them into the masters' ``.grad`` and divide by the
loss scale there (fp32: nothing flushes), clip by the global norm, step the torch optimizer on
the masters, and round the masters back into the model's parameters. Why masters: an update
smaller than half the spacing of fp16 numbers around w (w x 2^-11) rounds away entirely when
added to a fp16 w, every step, forever; in fp32 it accumulates until it shows.

The gradients are the caller's: in data parallelism they are all-reduced (a DDP wrapper)
before `step`, so every rank's are the same and the global norm is computed locally. ZeRO
shards the masters and states instead, and uses the scaler on its shards (see
`tinyscale.precision`'s docstring).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from tinyscale.precision.scaler import LossScaler

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]
LOW_PRECISION = (torch.float16, torch.bfloat16)


def _param_groups(params_or_groups) -> tuple[list[dict], list[torch.Tensor]]:
    """torch's forms (tensors, or dicts with "params") -> (groups of trainable, distinct
    parameters; the frozen ones, which are cast too but get no master)."""
    items = list(params_or_groups)
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    seen: set[int] = set()
    out, frozen = [], []
    for g in groups:
        params = []
        for p in g["params"]:
            if id(p) in seen:  # a tied weight is one parameter
                continue
            seen.add(id(p))
            (params if p.requires_grad else frozen).append(p)
        out.append({**g, "params": params})
    return out, frozen


class MixedPrecisionOptimizer:
    """fp32 masters and optimizer states behind a model whose parameters are cast to `dtype`.

    Give it the model's parameters *in fp32* (or float64): the masters are exact copies, and
    only then are the parameters rounded to `dtype` in place (same Parameter objects, so the
    model keeps working; build it before a DDP wrapper that allocates buffers by dtype).
    Frozen parameters passed in are cast too, and get no master. Parameters already in fp16/bf16 are accepted too (a
    low-precision checkpoint): their masters then start from the rounded values.

    `make_optimizer(param_groups)` builds the torch optimizer over the masters (groups keep
    their own hyperparameters). `loss_scaler`: a `DynamicLossScaler` or `StaticLossScaler` for
    fp16; None for bf16, whose range is fp32's and needs none. `process_group`: the ranks that
    must agree on overflow (None: the default group, if any): every rank whose skipping or
    stepping must match this one's (the data-parallel group; the engine passes the whole world,
    since under tensor or pipeline parallelism the other ranks hold the rest of the model).
    """

    def __init__(self, params_or_groups, make_optimizer: OptimizerFactory, *, dtype: torch.dtype,
                 loss_scaler: LossScaler | None = None, process_group=None):
        if dtype not in (*LOW_PRECISION, torch.float32):
            raise ValueError(f"MixedPrecisionOptimizer dtype={dtype}: use torch.float16 or torch.bfloat16 "
                             "(torch.float32 gives plain fp32 training through the same code path)")
        groups, frozen = _param_groups(params_or_groups)
        self.params = [p for g in groups for p in g["params"]]
        if not self.params:
            raise ValueError("MixedPrecisionOptimizer: no parameter requires grad")
        for p in self.params:
            if not p.is_floating_point():
                raise ValueError(f"MixedPrecisionOptimizer: a parameter has dtype {p.dtype}; only floating "
                                 "point parameters can be trained")
        self.dtype = dtype
        self.loss_scaler = loss_scaler
        self.process_group = process_group
        # --8<-- [start:masters]
        with torch.no_grad():
            # Masters first, from the full-precision values; then round the model's copy.
            self.masters = [p.detach().to(torch.float32, copy=True) for p in self.params]
            for p in self.params + [p for p in frozen if p.is_floating_point()]:
                p.grad = None  # a stale fp32 gradient would not match the new dtype
                p.data = p.data.to(dtype)  # same Parameter object, now fp16/bf16 (frozen ones too)
        by_id = {id(p): m for p, m in zip(self.params, self.masters)}
        self.optimizer = make_optimizer([{**g, "params": [by_id[id(p)] for p in g["params"]]}
                                         for g in groups if g["params"]])
        # --8<-- [end:masters]
        self.last_grad_norm: float | None = None

    @property
    def param_groups(self) -> list[dict]:
        """The torch optimizer's groups (set "lr" here; `tinyscale.optim.set_lr` works on this)."""
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.loss_scaler is None else self.loss_scaler.scale

    def backward(self, loss: torch.Tensor) -> None:
        """(loss x S).backward(): gradients land in the model's fp16/bf16 ``.grad``, scaled."""
        (loss if self.loss_scaler is None else self.loss_scaler.scale_loss(loss)).backward()

    # --8<-- [start:step]
    @torch.no_grad()
    def step(self, max_norm: float = 0.0) -> bool:
        """One update from the model's gradients; returns True if it was skipped (overflow)."""
        if max_norm < 0:
            raise ValueError(f"max_norm={max_norm} is invalid: use 0 (no clipping) or a positive norm")
        grads = [p.grad for p in self.params]
        scaler = self.loss_scaler
        if scaler is not None and scaler.found_overflow(grads, self.process_group):
            scaler.update(True)  # every rank got the same answer: all skip, all back off
            return True
        for m, g in zip(self.masters, grads):
            m.grad = None if g is None else g.to(torch.float32)  # exact: fp32 holds every fp16/bf16
        if scaler is not None:
            scaler.unscale_(m.grad for m in self.masters)  # the S of this backward: update() comes last
        if max_norm > 0:  # on the true (unscaled) gradients: max_norm means what it says
            self.last_grad_norm = self.clip_grad_norm_(max_norm)
        self.optimizer.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)  # round to nearest: the model computes with the rounded masters
            m.grad = None  # the fp32 gradient copy lives only during the step
        if scaler is not None:
            scaler.update(False)
        return False
    # --8<-- [end:step]

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the masters' fp32 gradients by their global norm (torch's rule); returns the norm.
        A layout whose ranks hold pieces of the model (tensor or pipeline parallelism) replaces
        this with a norm summed over those pieces, each counted once (the engine does)."""
        return float(torch.nn.utils.clip_grad_norm_(self.masters, max_norm))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes held right now by each kind of model state (gradients: only while they exist)."""
        def size(ts):
            return sum(t.numel() * t.element_size() for t in ts)

        states = [v for s in self.optimizer.state.values() for v in s.values()
                  if torch.is_tensor(v) and v.dim() > 0]  # Adam's scalar `step` is not per-parameter
        return {"params": size(self.params), "grads": size(p.grad for p in self.params if p.grad is not None),
                "master": size(self.masters), "optimizer_states": size(states)}

    def state_dict(self) -> dict:
        """Masters, the torch optimizer's state and the scaler's: resuming needs all three (the
        fp16 parameters alone have lost the masters' low bits)."""
        # Copies: torch's optimizer state_dict holds references that the next step updates in place.
        return {"masters": [m.detach().clone() for m in self.masters],
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if len(state["masters"]) != len(self.masters):
            raise ValueError(f"state has {len(state['masters'])} master tensors, this optimizer "
                             f"{len(self.masters)}: it was saved for a different model")
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.masters, state["masters"]):
                m.copy_(saved)
                p.copy_(m)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
