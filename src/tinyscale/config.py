"""`EngineConfig`: one validated training configuration, in DeepSpeed's key names.

A DeepSpeed user can bring their JSON: ``train_batch_size``,
``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``optimizer``,
``scheduler``, ``gradient_clipping``, ``zero_optimization``, ``fp16``, ``bf16`` mean what
they mean there. Parallel degrees, which DeepSpeed spreads over several places, live under
``parallel``. Unknown keys and impossible values are rejected at load time with the field
named (``ConfigError``), before any process group exists.

The batch identity every layout must satisfy (`EngineConfig.batch`):

    train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp

Give any two of the three (or just one of the batch sizes) and the rest is derived, as in
DeepSpeed. dp is the data-parallel size: world size / (tensor x pipeline x context).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, Strict, ValidationError,
                      field_validator, model_validator)

from tinyscale.config_deepspeed import screen
from tinyscale.deepspeed_keys import KEYS


class ConfigError(ValueError):
    """An invalid configuration; the message names the field and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _a_number(value: Any) -> Any:
    # Strict types: JSON's `true` or `"8"` where a number belongs is a mistake, not a 1 or an 8.
    # An int where a float belongs is plain JSON (`"lr": 1`) and stays accepted, and so does an
    # integral float where an int belongs (`"reduce_bucket_size": 5e8`, as DeepSpeed's configs write it).
    if isinstance(value, bool):
        raise ValueError(f"must be a number, not the boolean {value!r}")
    if isinstance(value, str):
        raise ValueError(f"must be a number, not the string {value!r}; write the number without quotes")
    return value


Int = Annotated[int, BeforeValidator(_a_number)]
Float = Annotated[float, BeforeValidator(_a_number)]
Bool = Annotated[bool, Strict()]  # only true/false: not 1, not "yes"
PositiveInt = Annotated[Int, Field(gt=0)]


class OptimizerParams(_Section):
    lr: Float = Field(1e-3, gt=0)
    betas: tuple[Float, Float] = (0.9, 0.999)
    eps: Float = Field(1e-8, gt=0)
    weight_decay: Float = Field(0.0, ge=0)
    momentum: Float = Field(0.0, ge=0, lt=1)  # SGD only
    nesterov: Bool = False  # SGD only
    # Adam only. DeepSpeed's "Adam" decouples weight decay (AdamW) unless this is false.
    adam_w_mode: Bool = True

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each beta must be in [0, 1), got {list(v)}")
        return v


class OptimizerConfig(_Section):
    type: Literal["AdamW", "Adam", "SGD"] = "AdamW"
    params: OptimizerParams = OptimizerParams()

    @field_validator("type", mode="before")
    @classmethod
    def _canonical_name(cls, v: Any) -> Any:
        names = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}
        return names.get(v.lower(), v) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _sgd_only_fields(self) -> OptimizerConfig:
        p = self.params
        if self.type != "Adam" and "adam_w_mode" in p.model_fields_set:
            raise ValueError(f"params.adam_w_mode applies to type Adam only, not {self.type}; remove it")
        if self.type != "SGD" and (p.momentum or p.nesterov):
            raise ValueError(f"params.momentum/nesterov apply to SGD only, not {self.type}; remove them")
        if self.type == "SGD" and p.nesterov and p.momentum == 0:
            raise ValueError("SGD with nesterov=true needs params.momentum > 0")
        return self


class SchedulerParams(_Section):
    """DeepSpeed's scheduler keys and defaults (`tinyscale.optim.lr_at` has the formulas).

    WarmupLR and WarmupDecayLR warm up from ``warmup_min_lr`` (0) to ``warmup_max_lr`` (0.001,
    not the optimizer's lr: ``"auto"`` means the optimizer's lr), then hold (WarmupLR) or decay
    linearly back to ``warmup_min_lr`` at ``total_num_steps`` (WarmupDecayLR). WarmupCosineLR
    scales the optimizer's lr instead: warm-up from ``warmup_min_ratio`` (0) x lr to lr, then a
    cosine down to ``cos_min_ratio`` (0.0001) x lr. All three warm up over ``warmup_num_steps``
    (1000) steps, logarithmically unless ``warmup_type`` is "linear"."""

    warmup_min_lr: Float | None = Field(None, ge=0)  # None: the type's default (set by SchedulerConfig)
    warmup_max_lr: Float | None = Field(None, gt=0)
    warmup_num_steps: Int = Field(1000, ge=0)
    warmup_type: Literal["linear", "log"] = "log"
    total_num_steps: PositiveInt | None = None
    warmup_min_ratio: Float | None = Field(None, ge=0, le=1)
    cos_min_ratio: Float | None = Field(None, ge=0, le=1)


# The keys each DeepSpeed scheduler type takes beyond the warm-up's, with DeepSpeed's defaults;
# a key of another type is refused, as DeepSpeed's constructor refuses it.
_SCHEDULER_OWN_KEYS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001},
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001},
    "WarmupCosineLR": {"warmup_min_ratio": 0.0, "cos_min_ratio": 0.0001},
}


class SchedulerConfig(_Section):
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
        if self.type != "WarmupCosineLR" and p.warmup_max_lr < p.warmup_min_lr:
            raise ValueError(f"params.warmup_max_lr ({p.warmup_max_lr}) is below params.warmup_min_lr "
                             f"({p.warmup_min_lr})")
        return self


class OffloadConfig(_Section):
    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    pin_memory: Bool = False


class ZeroConfig(_Section):
    stage: Int = Field(0, ge=0, le=3)
    reduce_bucket_size: PositiveInt = 500_000_000  # elements per gradient bucket (DeepSpeed's unit)
    overlap_comm: Bool = True
    offload_optimizer: OffloadConfig = OffloadConfig()
    offload_param: OffloadConfig = OffloadConfig()

    @model_validator(mode="after")
    def _offload_fits_the_stage(self):
        # DeepSpeed's rules: the optimizer lives on the host only if it is sharded (stage >= 1),
        # parameters only if they are sharded (stage 3); files need a place.
        if self.offload_optimizer.device != "none" and self.stage == 0:
            raise ValueError("offload_optimizer.device needs zero_optimization.stage >= 1 (the optimizer "
                             "state is offloaded shard by shard); set stage to 1, 2 or 3")
        if self.offload_param.device != "none" and self.stage != 3:
            raise ValueError(f"offload_param.device needs zero_optimization.stage 3 (got {self.stage}): only "
                             "stage 3 shards the parameters; set stage 3 or offload_param.device 'none'")
        for name in ("offload_optimizer", "offload_param"):
            section = getattr(self, name)
            if section.device == "nvme" and not section.nvme_path:
                raise ValueError(f"{name}.nvme_path is required with device 'nvme': the directory its "
                                 "swap files go in (a fast local disk)")
        return self


class Fp16Config(_Section):
    enabled: Bool = False
    loss_scale: Float = Field(0.0, ge=0)  # 0 = dynamic
    initial_scale_power: Int = Field(16, ge=0, le=64)
    loss_scale_window: PositiveInt = 1000
    hysteresis: PositiveInt = 2
    min_loss_scale: Float = Field(1.0, gt=0)
    consecutive_hysteresis: Bool = False  # a clean step restores the whole hysteresis (DeepSpeed's meaning)
    # An overflow at min_loss_scale raises (DeepSpeed's ZeRO optimizers do; its stage-0 fp16
    # optimizer skips instead): there the gradients overflow unscaled, so training has diverged.
    raise_error_at_min_scale: Bool = True


class Bf16Config(_Section):
    enabled: Bool = False


class ActivationCheckpointingConfig(_Section):
    """tinyscale's own section (DeepSpeed leaves the choice of what to recompute to model
    code): a policy from `tinyscale.checkpointing.POLICIES` applied to the GPT's blocks."""

    policy: Literal["none", "full", "every_k", "selective", "offload"] = "none"
    every_k: PositiveInt | None = None  # policy "every_k": checkpoint every k-th block
    use_reentrant: Bool = False

    @model_validator(mode="after")
    def _every_k_with_its_policy(self):
        if (self.policy == "every_k") != (self.every_k is not None):
            raise ValueError("activation_checkpointing.every_k goes with policy 'every_k' (and it needs one): "
                             f"got policy {self.policy!r}, every_k {self.every_k!r}")
        return self


class ParallelConfig(_Section):
    tensor: PositiveInt = 1
    pipeline: PositiveInt = 1
    context: PositiveInt = 1
    sequence_parallel: Bool = False
    pipeline_schedule: Literal["afab", "1f1b", "interleaved", "zero_bubble"] = "1f1b"
    virtual_stages: PositiveInt = 1
    context_algorithm: Literal["ring", "ulysses"] = "ring"


@dataclass(frozen=True)
class BatchLayout:
    """The resolved batch identity: train_batch_size = micro x accumulation x dp."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    dp: int


class EngineConfig(_Section):
    train_batch_size: PositiveInt | None = None
    train_micro_batch_size_per_gpu: PositiveInt | None = None
    gradient_accumulation_steps: PositiveInt | None = None
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig | None = None
    gradient_clipping: Float = Field(0.0, ge=0)  # max global gradient norm; 0 = off
    zero_optimization: ZeroConfig = ZeroConfig()
    fp16: Fp16Config = Fp16Config()
    bf16: Bf16Config = Bf16Config()
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()
    wall_clock_breakdown: Bool = False  # profile every step (engine.profiler; tinyscale.mfu)
    steps_per_print: PositiveInt = 10  # log progress every this many steps (logger tinyscale.engine, INFO)
    parallel: ParallelConfig = ParallelConfig()
    _notes: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _consistent(self) -> EngineConfig:
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true; enable at most one")
        if self.train_batch_size is None and self.train_micro_batch_size_per_gpu is None:
            raise ValueError(
                "set train_batch_size (the global batch, in rows) or train_micro_batch_size_per_gpu"
            )
        return self

    @classmethod
    def load(cls, config: EngineConfig | dict | str | Path) -> EngineConfig:
        """From a dict, a path to .json/.yaml/.yml, or an EngineConfig (returned as is)."""
        if isinstance(config, EngineConfig):
            return config
        if isinstance(config, (str, Path)):
            config = _read_file(Path(config))
        if not isinstance(config, dict):
            raise ConfigError(f"config must be a dict, a .json/.yaml path or an EngineConfig, got {type(config).__name__}")
        # DeepSpeed's vocabulary first: "auto" resolved, keys noted or refused (tinyscale.deepspeed_keys)
        config, notes, refused = screen(config)
        try:
            loaded = cls.model_validate(config)
        except ValidationError as err:
            refused += _explain(err, config)
        if refused:
            raise ConfigError("invalid config:\n  " + "\n  ".join(refused))
        loaded._notes = tuple(notes)
        return loaded

    @property
    def notes(self) -> tuple[str, ...]:
        """DeepSpeed keys that were accepted but have no effect here, each with the reason."""
        return self._notes

    # --8<-- [start:batch-identity]
    def batch(self, dp: int) -> BatchLayout:
        """Resolve the batch identity for a data-parallel size, DeepSpeed's way."""
        tbs, micro, accum = (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                             self.gradient_accumulation_steps)
        given = (f"train_batch_size={tbs}, train_micro_batch_size_per_gpu={micro}, "
                 f"gradient_accumulation_steps={accum}, data-parallel size={dp}")
        if tbs is not None and micro is not None and accum is not None:
            if tbs != micro * accum * dp:
                raise ConfigError(
                    f"train_batch_size must equal train_micro_batch_size_per_gpu x "
                    f"gradient_accumulation_steps x data-parallel size: {micro} x {accum} x {dp} = "
                    f"{micro * accum * dp}, not {tbs} ({given}). Change one, or leave one out to derive it."
                )
        elif tbs is not None and micro is not None:
            accum, rem = divmod(tbs, micro * dp)
            if rem or accum == 0:
                raise ConfigError(f"train_batch_size is not a multiple of micro batch x dp ({given})")
        elif tbs is not None:
            accum = accum or 1
            micro, rem = divmod(tbs, accum * dp)
            if rem or micro == 0:
                raise ConfigError(
                    f"train_batch_size must be a multiple of gradient_accumulation_steps x "
                    f"data-parallel size ({given})"
                )
        else:
            accum = accum or 1
            tbs = micro * accum * dp
        return BatchLayout(tbs, micro, accum, dp)
    # --8<-- [end:batch-identity]


def _read_file(path: Path) -> dict:
    """The dict a .json/.yaml file holds; every failure is a `ConfigError` naming the file (and,
    for a syntax error, the line and column the parser stopped at)."""
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; give the path of a .json or .yaml file in it")
    if path.suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(f"config file {path}: use a .json, .yaml or .yml file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {path}, line {exc.lineno}, column {exc.colno}: invalid JSON: "
                              f"{exc.msg}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError(f"config file {path}{where}: invalid YAML: {problem}") from None
        data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} holds a {type(data).__name__}, not a mapping of config keys "
                          "(e.g. {\"train_batch_size\": 8})")
    return data


def _known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the section at `loc` (for "did you mean" hints)."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        candidates = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not candidates:
            return []
        model = candidates[0]
    return list(model.model_fields)


def _explain(err: ValidationError, raw: dict) -> list[str]:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        where = ".".join(str(p) for p in loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            section = ".".join(str(part) for part in loc[:-1])  # DeepSpeed's keys of it are candidates too
            deepspeed = [k.path.rsplit(".", 1)[-1] for k in KEYS if (k.path.rpartition(".")[0]) == section]
            hint = difflib.get_close_matches(str(loc[-1]), _known_keys(EngineConfig, loc) + deepspeed, n=1)
            fix = f"; did you mean '{hint[0]}'?" if hint else "; remove it"
            lines.append(f"config field '{where}': unknown key{fix}")
        else:
            got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"config field '{where}': {msg}{got}")
    return lines
