"""Loss scaling for fp16: a dynamic scaler with DeepSpeed's rule, a static one, and the overflow
check that every rank agrees on.

Paper: Micikevicius et al., "Mixed Precision Training" (ICLR 2018), sec. 3.2 (loss scaling);
the dynamic rule is DeepSpeed's ``DynamicLossScaler`` (itself from Megatron-LM), with its
``fp16`` config keys and defaults. Lesson: lessons/04-mixed-precision.md. Tests:
``pytest -k mixed_precision`` (tests/precision/).

Why: fp16 holds magnitudes from 2^-24 (the smallest subnormal) to 65504, and many gradients
are smaller than 2^-24: they become 0. Multiplying the loss by S before backward multiplies
every gradient by S (the chain rule is linear), lifting them into range; the optimizer must
then see g / S, and a step whose scaled gradients overflowed (inf or nan) must be skipped.

One step, in order (`MixedPrecisionOptimizer` and ZeRO's sharded step both follow it):

    (scaler.scale(loss)).backward()           # gradients are S x the true ones
    overflow = scaler.found_overflow(grads, group)   # one all-reduce MAX: every rank agrees
    if not overflow:
        scaler.unscale_(fp32_grads)           # g / S, in fp32 (in fp16 small ones would flush again)
        ...clip, optimizer step...
    scaler.update(overflow)                   # -> skipped; S for the next step

The order matters on a growth step: unscale with the S the loss was multiplied by, then let
`update` double it. DeepSpeed 0.19.8 updates first (`_update_scale` before
`unscale_and_clip_grads`, in FP16_Optimizer and in ZeRO's optimizers), so its growth steps
apply half the gradient; tinyscale keeps this order (lesson 04; ``pytest -k deepspeed_agreement``
runs DeepSpeed's engine and shows it).

The dynamic rule (hysteresis h, window W, both DeepSpeed's; c = clean steps in a row since the
last overflow or the start, this one included):

    overflow     if h_left == 1: S = max(S / 2, min_loss_scale)   (raises if S was already the min)
                 else:           h_left -= 1                        (S unchanged)
                 the step is skipped either way; c restarts at 0
    no overflow  c += 1; if the rule says grow: S *= 2, h_left = h
                 with consecutive_hysteresis, every clean step resets h_left = h
    grow         "deepspeed" (the default, and DeepSpeed's ZeRO optimizers' DynamicLossScaler):
                 c - 1 is a positive multiple of W, i.e. clean steps W+1, 2W+1, ... (its
                 stable_interval = it - last_overflow - 1 counts the clean steps before this one)
                 "torch" (torch.amp.GradScaler's growth_interval): c is a multiple of W

So with h = 2 the first overflow only uses up the spare, and every later one halves S, until
a run of clean steps doubles S and restores the spare. With h = 1 and growth "torch" it is
torch.amp.GradScaler's rule (growth 2, backoff 0.5, growth_interval W); with growth
"deepspeed" it is DeepSpeed's. The tests check both step by step against the real ones.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from tinyscale.dist import comm
from tinyscale.dist import device as rank_device


def _require(ok: bool, field: str, value, fix: str) -> None:
    if not ok:
        raise ValueError(f"fp16.{field}={value!r} is invalid: {fix}")


# --8<-- [start:found-overflow]
def found_overflow(tensors: Iterable[torch.Tensor | None], group=None) -> bool:
    """True on every rank if any rank's `tensors` hold an inf or a nan.

    One all-reduce (MAX) of a 0/1 flag over `group` (None: the default group, if any), so one
    rank's inf makes every rank skip the step and back off together: ranks that disagreed would
    step differently and their parameters (or ZeRO shards) would silently drift apart.
    """
    flag = None
    for t in tensors:
        if t is not None:
            bad = (~torch.isfinite(t)).any().float()  # () on t's device; no host sync per tensor
            flag = bad if flag is None else torch.maximum(flag, bad)
    if flag is None:  # no gradient here (a rank whose shard got none): still joins the all-reduce
        flag = torch.zeros((), device=rank_device())
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=group)
    return bool(flag.item())
# --8<-- [end:found-overflow]


class LossScaler:
    """What both scalers share: scale the loss, check for overflow, unscale. Subclasses set
    `update`. `scale` is a Python float: a power of two, so scaling and unscaling are exact
    (only an exponent changes) unless a value leaves the format's range."""

    dynamic = False

    def __init__(self, scale: float):
        self.scale = float(scale)
        self.overflows = 0  # steps skipped so far (for logs and plots)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss x S: backward of this gives S x every gradient."""
        return loss * self.scale

    def found_overflow(self, tensors: Iterable[torch.Tensor | None], group=None) -> bool:
        return found_overflow(tensors, group)

    # --8<-- [start:unscale]
    @torch.no_grad()
    def unscale_(self, tensors: Iterable[torch.Tensor | None]) -> None:
        """In place: t /= S. Give it the fp32 copies of the gradients: in fp16, g / S would
        flush the small gradients to zero again, undoing what the scale was for."""
        inv = 1.0 / self.scale
        for t in tensors:
            if t is None:
                continue
            if t.dtype == torch.float16:
                raise ValueError("unscale_ got a float16 tensor: unscaling in fp16 flushes small "
                                 "gradients to zero; unscale the fp32 (master) copies instead")
            t.mul_(inv)
    # --8<-- [end:unscale]

    def update(self, overflow: bool) -> bool:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"scale": self.scale, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.overflows = int(state["overflows"])


class StaticLossScaler(LossScaler):
    """A fixed scale (fp16.loss_scale > 0). An overflowing step is still skipped: applying an inf
    would destroy the master weights. The scale itself never changes."""

    def __init__(self, loss_scale: float):
        _require(loss_scale > 0 and loss_scale != float("inf"), "loss_scale", loss_scale,
                 "a static scale must be a finite number > 0 (0 selects dynamic scaling)")
        super().__init__(loss_scale)

    def update(self, overflow: bool) -> bool:
        """Returns whether this step is skipped (= overflow)."""
        self.overflows += bool(overflow)
        return bool(overflow)


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic loss scaler (rule in the module docstring), with its defaults."""

    dynamic = True

    def __init__(self, initial_scale_power: int = 16, loss_scale_window: int = 1000, hysteresis: int = 2,
                 min_loss_scale: float = 1.0, consecutive_hysteresis: bool = False,
                 raise_at_min_scale: bool = True, growth: str = "deepspeed"):
        _require(isinstance(initial_scale_power, int) and 0 <= initial_scale_power <= 64, "initial_scale_power",
                 initial_scale_power, "it must be an int in [0, 64] (the first scale is 2**initial_scale_power)")
        _require(isinstance(loss_scale_window, int) and loss_scale_window > 0, "loss_scale_window",
                 loss_scale_window, "it must be a positive int (clean steps before the scale doubles)")
        _require(isinstance(hysteresis, int) and hysteresis > 0, "hysteresis", hysteresis,
                 "it must be a positive int (overflows tolerated before the scale halves; 1 = every one)")
        _require(min_loss_scale > 0, "min_loss_scale", min_loss_scale, "it must be > 0 (e.g. 1)")
        _require(min_loss_scale <= 2.0**initial_scale_power, "min_loss_scale", min_loss_scale,
                 f"it must not exceed the initial scale 2**{initial_scale_power}; lower it or raise "
                 "initial_scale_power")
        _require(growth in ("deepspeed", "torch"), "growth", growth, "use 'deepspeed' or 'torch'")
        super().__init__(2.0**initial_scale_power)
        self.growth = growth
        self.window = loss_scale_window
        self.hysteresis = hysteresis
        self.min_scale = float(min_loss_scale)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_at_min_scale = raise_at_min_scale
        self.hysteresis_left = hysteresis
        self.clean_steps = 0  # clean steps in a row since the last overflow (or the start)

    # --8<-- [start:update]
    def update(self, overflow: bool) -> bool:
        """Advance the rule by one step; returns whether this step is skipped (= overflow)."""
        if overflow:
            self.overflows += 1
            self.clean_steps = 0
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1  # tolerated: skip the step, keep the scale
            elif self.scale <= self.min_scale and self.raise_at_min_scale:
                raise FloatingPointError(
                    f"fp16 gradients overflow at the minimum loss scale {self.min_scale:g}: training has "
                    "diverged (inf/nan even without scaling). Lower the learning rate, check the data, "
                    "or use bf16; lowering fp16.min_loss_scale only helps if the scale, not the model, is the cause")
            else:
                self.scale = max(self.scale / 2, self.min_scale)
            return True
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        self.clean_steps += 1
        before = self.clean_steps - (self.growth == "deepspeed")  # DeepSpeed counts the clean steps before this one
        if before > 0 and before % self.window == 0:
            self.scale *= 2
            self.hysteresis_left = self.hysteresis
        return False
    # --8<-- [end:update]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "hysteresis_left": self.hysteresis_left, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.hysteresis_left = int(state["hysteresis_left"])
        self.clean_steps = int(state["clean_steps"])


def make_loss_scaler(loss_scale: float = 0.0, initial_scale_power: int = 16, loss_scale_window: int = 1000,
                     hysteresis: int = 2, min_loss_scale: float = 1.0,
                     consecutive_hysteresis: bool = False, raise_error_at_min_scale: bool = True) -> LossScaler:
    """The scaler DeepSpeed's ``fp16`` section describes: loss_scale 0 -> dynamic, > 0 -> static.

    Takes the section's keys by name: ``make_loss_scaler(**config.fp16.model_dump(exclude={"enabled"}))``.
    """
    _require(loss_scale >= 0, "loss_scale", loss_scale, "use 0 for dynamic scaling or a positive static scale")
    if loss_scale > 0:
        return StaticLossScaler(loss_scale)
    return DynamicLossScaler(initial_scale_power, loss_scale_window, hysteresis, min_loss_scale,
                             consecutive_hysteresis, raise_at_min_scale=raise_error_at_min_scale)
