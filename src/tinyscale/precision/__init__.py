"""Mixed precision: fp16/bf16 parameters for compute, fp32 master weights, loss scaling for fp16.

Paper: Micikevicius et al., "Mixed Precision Training" (ICLR 2018), sec. 3; the scaler's rule
and config keys are DeepSpeed's (``fp16: {loss_scale, initial_scale_power, loss_scale_window,
hysteresis, min_loss_scale}``). Tests: ``pytest -k mixed_precision``.

    from tinyscale.precision import MixedPrecisionOptimizer, make_loss_scaler
    opt = MixedPrecisionOptimizer(model.parameters(), lambda groups: torch.optim.AdamW(groups, lr=1e-3),
                                  dtype=torch.float16, loss_scaler=make_loss_scaler(), process_group=dp_group)
    opt.backward(model(x, y))      # (loss x S).backward()
    skipped = opt.step(max_norm=1.0)
    opt.zero_grad()

| piece | file | what it does |
| --- | --- | --- |
| `DynamicLossScaler` | `scaler.py` | DeepSpeed's rule: halve on overflow (after `hysteresis` of them), double on the clean step after `loss_scale_window` of them |
| `StaticLossScaler` | `scaler.py` | a fixed scale; overflowing steps are still skipped |
| `found_overflow` | `scaler.py` | inf/nan anywhere on any rank -> True on every rank (one all-reduce MAX) |
| `MixedPrecisionOptimizer` | `optimizer.py` | fp32 masters and states, unscale, clip, step, round back |
| `cast_report` | `formats.py` | what a cast to fp16/bf16 does to real values: flushed, subnormal, overflowed |

The seam (`IMPLEMENTATIONS`, `tinyscale.testing.implementations`) covers the scaler. A
scaler is any class built with DeepSpeed's keyword names (``initial_scale_power``,
``loss_scale_window``, ``hysteresis``, ``min_loss_scale``, ``consecutive_hysteresis``) that has
a float attribute ``scale`` and ``update(overflow: bool) -> skipped: bool``,
``found_overflow(tensors, group) -> bool`` (the same on every rank), ``unscale_(tensors)``,
``state_dict()`` and ``load_state_dict(state)``.

ZeRO uses the same scaler on its shards: a rank's gradient shard is all it has, so the
overflow flag must be agreed over the data-parallel group before anyone steps (and over the
whole world when tensor or pipeline parallel ranks hold the rest of the model: the engine
passes that group; lessons/04-mixed-precision.md, "Mixed precision in every layout"):

    if scaler.found_overflow(shard_grads, dp_group):   # the same answer on every rank
        scaler.update(True); drop the gradient shards; return   # every rank skips together
    fp32 = [g.float() for g in shard_grads]; scaler.unscale_(fp32)
    ...clip (norm summed over ranks), step the fp32 master shards, all-gather them as fp16...
    scaler.update(False)                                 # after unscale_: it may double S

The lesson: lessons/04-mixed-precision.md.
"""

from tinyscale.precision.formats import CastReport, FormatLimits, cast_report, limits
from tinyscale.precision.optimizer import MixedPrecisionOptimizer
from tinyscale.precision.scaler import (
    DynamicLossScaler,
    LossScaler,
    StaticLossScaler,
    found_overflow,
    make_loss_scaler,
)

# The seam (tinyscale.testing.implementations): name -> import string.
IMPLEMENTATIONS = {
    "tinyscale": "tinyscale.precision:DynamicLossScaler",
}

__all__ = [
    "IMPLEMENTATIONS",
    "CastReport",
    "DynamicLossScaler",
    "FormatLimits",
    "LossScaler",
    "MixedPrecisionOptimizer",
    "StaticLossScaler",
    "cast_report",
    "found_overflow",
    "limits",
    "make_loss_scaler",
]
