"""`EngineConfig`: one validated training configuration, in DeepSpeed's key names.

A DeepSpeed user can bring their JSON: ``train_batch_size``,
``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``optimizer``,
``scheduler``, ``gradient_clipping``, ``zero_optimization``, ``fp16``, ``bf16`` mean what
they mean there. Parallel degrees, which DeepSpeed spreads over several places, live under
``parallel``. Every other key DeepSpeed documents is known too, and honoured, noted or
refused with the reason (`tinyscale.deepspeed_keys`, docs/deepspeed-config.md); ``"auto"``
resolves where Hugging Face's integration would (`tinyscale.config_deepspeed`). Unknown keys,
values of the wrong type and impossible values are rejected at load time with the field
named (``ConfigError``; `tinyscale.config_input`), before any process group exists.
The ``scheduler`` section is in `tinyscale.config_schedule`.

The batch identity every layout must satisfy (`EngineConfig.batch`):

    train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp

Give any two of the three (or just one of the batch sizes) and the rest is derived, as in
DeepSpeed. dp is the data-parallel size: world size / (tensor x pipeline x context).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from tinyscale.config_deepspeed import screen
from tinyscale.config_input import Bool, ConfigError, Float, Int, PositiveInt, Section, explain, read_file
from tinyscale.config_monitor import HealthConfig, MonitorOutput
from tinyscale.config_schedule import RampupBatchSize, SchedulerConfig, SchedulerParams


class OptimizerParams(Section):
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


class OptimizerConfig(Section):
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


class OffloadConfig(Section):
    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    pin_memory: Bool = False


class ZeroConfig(Section):
    stage: Int = Field(0, ge=0, le=3)
    reduce_bucket_size: PositiveInt = 500_000_000  # elements per gradient bucket (DeepSpeed's unit)
    overlap_comm: Bool = True
    allgather_bucket_size: PositiveInt = 500_000_000  # stages 1-2: elements per post-step all-gather
    reduce_scatter: Bool = True  # stages 1-2; false: all-reduce, keep the slice (DeepSpeed's meaning)
    # stage 3: parameters with fewer elements stay whole on every rank (DeepSpeed's default is
    # 1e5; tinyscale's 0 shards every parameter, so the lesson's 3 Psi per micro-batch holds)
    stage3_param_persistence_threshold: Int = Field(0, ge=0)
    sub_group_size: PositiveInt = 1_000_000_000  # stages 1-3: elements per optimizer step (tinyscale.zero.sub_groups)
    # stage 3, elements (tinyscale.zero.stage3_prefetch): prefetch ahead while fewer than this are
    # in flight (null: one unit, tinyscale's default; DeepSpeed's is 5e7), and never past this many gathered
    stage3_prefetch_bucket_size: Int | None = Field(None, ge=0)
    stage3_max_live_parameters: PositiveInt = 1_000_000_000
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


class Fp16Config(Section):
    enabled: Bool = False
    loss_scale: Float = Field(0.0, ge=0)  # 0 = dynamic
    initial_scale_power: Int = Field(16, ge=0, le=64)
    loss_scale_window: PositiveInt = 1000
    hysteresis: PositiveInt = 2
    min_loss_scale: Int = Field(1, gt=0)  # an integer, as DeepSpeed's (0.5 is refused there too)
    consecutive_hysteresis: Bool = False  # a clean step restores the whole hysteresis (DeepSpeed's meaning)
    # An overflow at min_loss_scale raises (DeepSpeed's ZeRO optimizers do; its stage-0 fp16
    # optimizer skips instead): there the gradients overflow unscaled, so training has diverged.
    # tinyscale's own key: DeepSpeed 0.19.8's fp16 section has none (its ZeRO path always raises).
    raise_error_at_min_scale: Bool = True


class Bf16Config(Section):
    enabled: Bool = False


class ActivationCheckpointingConfig(Section):
    """tinyscale's own section (DeepSpeed leaves the choice of what to recompute to model
    code): a policy from `tinyscale.checkpointing.POLICIES` applied to the GPT's blocks."""

    policy: Literal["none", "full", "every_k", "selective", "offload"] = "none"
    every_k: PositiveInt | None = None  # policy "every_k": checkpoint every k-th block
    use_reentrant: Bool = False
    partition_activations: Bool = False  # DeepSpeed's: block inputs kept split over the TP group
    cpu_checkpointing: Bool = False  # DeepSpeed's: the checkpoints (saved inputs) kept in host memory

    @model_validator(mode="after")
    def _every_k_with_its_policy(self):
        if (self.policy == "every_k") != (self.every_k is not None):
            raise ValueError("activation_checkpointing.every_k goes with policy 'every_k' (and it needs one): "
                             f"got policy {self.policy!r}, every_k {self.every_k!r}")
        if self.partition_activations and self.policy not in ("full", "every_k"):
            raise ValueError("activation_checkpointing.partition_activations splits a checkpointed block's input "
                             f"over the tensor-parallel group, and policy {self.policy!r} saves none: use policy "
                             "'full' or 'every_k' (selective's q, k, v are split by heads already)")
        if self.cpu_checkpointing and self.policy not in ("full", "every_k", "selective"):
            raise ValueError("activation_checkpointing.cpu_checkpointing moves the checkpoints to the host, and "
                             f"policy {self.policy!r} keeps none: use 'full', 'every_k' or 'selective' (policy "
                             "'offload' moves every saved tensor already)")
        return self


class CompressionConfig(Section):
    """Gradient compression (tinyscale.compression; engine/compression.py says what composes)."""

    type: Literal["none", "topk", "randomk", "qsgd", "powersgd", "onebit_adam"] = "none"
    ratio: Float = Field(0.01, gt=0, le=1)  # topk, randomk: the fraction of elements sent
    bits: Literal[8, 4] = 8  # qsgd
    norm: Literal["max", "l2"] = "max"  # qsgd's scale: "l2" is the paper's QSGD, "max" the max-norm variant
    error_feedback: Bool = True  # topk, randomk, qsgd, powersgd: what is not sent is sent later
    rank: PositiveInt = 1  # powersgd: matrix_approximation_rank
    start_iter: PositiveInt = 2  # powersgd: plain all-reduce before this step (torch's start_powerSGD_iter)
    min_compression_rate: Float = Field(2.0, ge=0)  # powersgd: compress a matrix only if it saves this factor
    freeze_step: PositiveInt = 100  # onebit_adam: exact Adam steps before the variance is frozen
    seed: Int = 0  # randomk's shared indices, qsgd's rounding, powersgd's first Q


class ParallelConfig(Section):
    tensor: PositiveInt = 1
    pipeline: PositiveInt = 1
    context: PositiveInt = 1
    sequence_parallel: Bool = False
    # dropout with tensor > 1: "exact" draws one process's masks (equals it bit for bit, t times the
    # random numbers); "tracker" each rank's own stream inside the region (Megatron's RNG tracker)
    tensor_dropout: Literal["exact", "tracker"] = "exact"
    pipeline_schedule: Literal["afab", "1f1b", "interleaved_1f1b", "zb_h1"] = "1f1b"  # tinyscale.pipeline
    virtual_stages: PositiveInt = 1
    # ZeRO stage 3 with a pipeline: free a stage's parameters after every pass and gather them
    # again for the next (true), or keep them while any of its micro-batches is in flight (false)
    pipeline_reshard_after_forward: Bool = False
    context_algorithm: Literal["ring", "ulysses"] = "ring"
    context_sharding: Literal["zigzag", "contiguous"] = "zigzag"  # tinyscale.context_parallel.sharding
    expert: PositiveInt = 1  # expert parallelism: an MoE GPT's experts split over this many dp ranks (engine/expert.py)
    # AutoTP (a model tinyscale did not write, tensor > 1): module-name pattern -> style, read before
    # the built-in Llama-family names (tinyscale.tensor_parallel.auto)
    tp_plan: dict[str, Literal["colwise", "rowwise", "colwise_gather_output", "vocab", "replicate"]] = \
        Field(default_factory=dict)


class CompileConfig(Section):
    """torch.compile of the GPT's blocks (engine/compiled.py): tinyscale's ``enabled``, and
    ``backend`` and ``compile_kwargs`` named as DeepSpeed's ``engine.compile`` arguments.
    ``"compile": true`` means ``{"enabled": true}``."""

    enabled: Bool = False
    backend: Literal["inductor", "aot_eager", "eager"] = "inductor"  # torch.compile's backend
    # torch.compile's other keywords (DeepSpeed's compile_kwargs): mode, dynamic, fullgraph, options
    compile_kwargs: dict[Literal["mode", "dynamic", "fullgraph", "options"], Any] = Field(default_factory=dict)


@dataclass(frozen=True)
class BatchLayout:
    """The resolved batch identity: train_batch_size = micro x accumulation x dp."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    dp: int


class EngineConfig(Section):
    train_batch_size: PositiveInt | None = None
    train_micro_batch_size_per_gpu: PositiveInt | None = None
    gradient_accumulation_steps: PositiveInt | None = None
    rampup_batch_size: RampupBatchSize | None = None  # tinyscale's own: Megatron's ramp (engine/batch_change.py)
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig | None = None
    gradient_clipping: Float = Field(0.0, ge=0)  # max global gradient norm; 0 = off
    # ZeRO stages 1-3: the dtype gradients are reduced in (DeepSpeed's); null: their own dtype
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    # DeepSpeed's; null: true (divide by dp before the sum) unless gradient_predivide_factor is set
    prescale_gradients: Bool | None = None
    gradient_predivide_factor: Float = Field(1.0, gt=0)
    zero_optimization: ZeroConfig = ZeroConfig()
    fp16: Fp16Config = Fp16Config()
    bf16: Bf16Config = Bf16Config()
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()
    wall_clock_breakdown: Bool = False  # profile every step (engine.profiler; tinyscale.mfu)
    steps_per_print: PositiveInt = 10  # log progress every this many steps (logger tinyscale.engine, INFO)
    tensorboard: MonitorOutput = MonitorOutput()  # DeepSpeed's monitors (tinyscale.engine.monitor)
    csv_monitor: MonitorOutput = MonitorOutput()
    monitor: HealthConfig = HealthConfig()  # tinyscale's own: straggler and loss-spike warnings
    parallel: ParallelConfig = ParallelConfig()
    compression: CompressionConfig = CompressionConfig()  # tinyscale's own section (not DeepSpeed's)
    compile: CompileConfig = CompileConfig()  # torch.compile of the blocks (engine/compiled.py)
    _notes: tuple[str, ...] = PrivateAttr(default=())

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_shorthand(cls, v: Any) -> Any:  # "compile": true / false
        return {"enabled": v} if isinstance(v, bool) else v

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
            config = read_file(Path(config))
        if not isinstance(config, dict):
            raise ConfigError(f"config must be a dict, a .json/.yaml path or an EngineConfig, got {type(config).__name__}")
        # DeepSpeed's vocabulary first: "auto" resolved, keys noted or refused (tinyscale.deepspeed_keys)
        config, notes, refused = screen(config)
        try:
            loaded = cls.model_validate(config)
        except ValidationError as err:
            refused += explain(err, cls)
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
