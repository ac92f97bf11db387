"""The ``scheduler`` section: DeepSpeed's learning-rate schedules, with their keys and defaults.

The formulas are in `tinyscale.optim.lr_at`; the defaults are DeepSpeed's, type by type
(`_SCHEDULER_OWN_KEYS`). Tests: ``pytest -k deepspeed_config`` and ``pytest -k lr_schedule``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tinyscale.config_input import Float, Int, PositiveInt, Section


class SchedulerParams(Section):
    """DeepSpeed's scheduler keys and defaults (`tinyscale.optim.lr_at` has the formulas).

    WarmupLR and WarmupDecayLR warm up from ``warmup_min_lr`` (0) to ``warmup_max_lr``, then hold
    (WarmupLR) or decay linearly back to ``warmup_min_lr`` at ``total_num_steps`` (WarmupDecayLR).
    ``warmup_max_lr`` defaults, as in DeepSpeed 0.19.8, to the optimizer's lr for WarmupLR (None
    here, read by `lr_at`) and to 0.001 for WarmupDecayLR; ``"auto"`` means the optimizer's lr.
    WarmupCosineLR scales the optimizer's lr instead: warm-up from ``warmup_min_ratio`` (0) x lr to
    lr, then a cosine down to ``cos_min_ratio`` (0.0001) x lr. All three warm up over
    ``warmup_num_steps`` (1000; at least 1, as DeepSpeed's constructors require) steps,
    logarithmically unless ``warmup_type`` is "linear"."""

    warmup_min_lr: Float | None = Field(None, ge=0)  # None: the type's default (set by SchedulerConfig)
    warmup_max_lr: Float | None = Field(None, gt=0)
    warmup_num_steps: Int = Field(1000, ge=1)  # DeepSpeed raises on 0
    warmup_type: Literal["linear", "log"] = "log"
    total_num_steps: PositiveInt | None = None
    warmup_min_ratio: Float | None = Field(None, ge=0, le=1)
    cos_min_ratio: Float | None = Field(None, ge=0, le=1)


# The keys each DeepSpeed scheduler type takes beyond the warm-up's, with DeepSpeed's defaults;
# a key of another type is refused, as DeepSpeed's constructor refuses it.
_SCHEDULER_OWN_KEYS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None},  # None: the optimizer's lr
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001},
    "WarmupCosineLR": {"warmup_min_ratio": 0.0, "cos_min_ratio": 0.0001},
}


class SchedulerConfig(Section):
    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"] = "WarmupLR"
    params: SchedulerParams = SchedulerParams()

    @model_validator(mode="before")
    @classmethod
    def _defaults_of_the_type(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("type", "WarmupLR") not in _SCHEDULER_OWN_KEYS:
            return data  # field validation names the bad type
        kind = data.get("type", "WarmupLR")
        params = dict(data.get("params") or {}) if isinstance(data.get("params", {}), dict) else data["params"]
        if isinstance(params, dict):
            own = _SCHEDULER_OWN_KEYS[kind]
            foreign = sorted(k for other in _SCHEDULER_OWN_KEYS.values() for k in other
                             if k in params and k not in own)
            if foreign:
                raise ValueError(f"params.{', params.'.join(foreign)} do not belong to {kind} (DeepSpeed's {kind} "
                                 f"takes {', '.join(own)}); remove them or change the type")
            for key, default in own.items():
                params.setdefault(key, default)
        return {**data, "params": params}

    @model_validator(mode="after")
    def _needs_total(self) -> SchedulerConfig:
        p = self.params
        if self.type != "WarmupLR":
            if p.total_num_steps is None:
                raise ValueError(f"{self.type} needs params.total_num_steps")
            if p.total_num_steps < p.warmup_num_steps:
                raise ValueError(
                    f"params.total_num_steps ({p.total_num_steps}) is less than "
                    f"params.warmup_num_steps ({p.warmup_num_steps})"
                )
        if self.type != "WarmupCosineLR" and p.warmup_max_lr is not None and p.warmup_max_lr < p.warmup_min_lr:
            raise ValueError(f"params.warmup_max_lr ({p.warmup_max_lr}) is below params.warmup_min_lr "
                             f"({p.warmup_min_lr})")
        return self


class RampupBatchSize(Section):
    """tinyscale's ``rampup_batch_size`` (Megatron's ``--rampup-batch-size start increment samples``;
    DeepSpeed has no such key): the global batch starts at ``start`` rows and grows by
    ``increment`` in equal slices of ``samples`` trained samples until it reaches
    ``train_batch_size`` (`tinyscale.engine.batch_change`)."""

    start: PositiveInt
    increment: PositiveInt
    samples: PositiveInt
