"""DeepSpeed's configuration vocabulary: every documented key, and what tinyscale does with it.

A DeepSpeed config loads here as it is written. Each key DeepSpeed documents is, in the table
below (`KEYS`, shown on the site as docs/deepspeed-config.md):

- **honoured**: a field of `tinyscale.config.EngineConfig`, with DeepSpeed's meaning;
- **noted**: accepted, no effect here; the reason is logged once at start-up (rank 0);
- **refused**: a `ConfigError` saying what DeepSpeed does with it and why tinyscale does not.

Many keys are honoured for some values and not others: ``"allgather_partitions": true``
describes what tinyscale always does, ``false`` asks for something it does not build.
`Key.same` names the values that mean what tinyscale does; those are accepted silently, any
other is treated as the key's `kind` says. ``"auto"``, as Hugging Face's integration writes it, is resolved by
`resolve_auto` where a value can be derived, and refused naming what to set where it cannot.
Misspelt keys are not in the table and still get "unknown key; did you mean ...".

Tests: ``pytest -k deepspeed_config`` (tests/engine/test_deepspeed_config.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Same = Callable[[Any, dict], bool]  # (value, the section holding it) -> means what tinyscale does


def _is(*values: Any) -> Same:
    return lambda v, _: any(v == x and type(v) is not bool or v is x for x in values)


def _disabled(v: Any, _: dict) -> bool:  # a whole section with "enabled": false, or false itself
    return v is False or v is None or (isinstance(v, dict) and v.get("enabled", False) is False)


def _never(v: Any, _: dict) -> bool:
    return False


@dataclass(frozen=True)
class Key:
    path: str  # dotted, e.g. "zero_optimization.reduce_scatter"
    kind: Literal["honoured", "noted", "refused"]
    why: str  # what DeepSpeed does with it, and what tinyscale does instead
    same: Same = _never  # values that mean what tinyscale does: accepted without a word
    same_doc: str = ""  # those values, for the docs table
    field: str = ""  # honoured under another name: the EngineConfig field it becomes (config_deepspeed.py)


def _h(path: str, why: str, field: str = "") -> Key:
    return Key(path, "honoured", why, field=field)


def _n(path: str, why: str, same: Same = _never, same_doc: str = "") -> Key:
    return Key(path, "noted", why, same, same_doc)


def _r(path: str, why: str, same: Same = _never, same_doc: str = "") -> Key:
    return Key(path, "refused", why, same, same_doc)


_MONITOR = ("DeepSpeed writes training metrics to {}; tinyscale writes them to TensorBoard and CSV files only "
            "(tensorboard, csv_monitor), and to engine.last_step")
_NOT_BUILT = "changes the model, data or update rule; tinyscale does not build it"
_OFF, _FALSE, _TRUE = "enabled false", "false", "true"
_DEEPCOMPILE = ("DeepCompile: DeepSpeed's graph passes that move ZeRO's gathers, reduce-scatters and offloads into "
                "the compiled graph; tinyscale compiles the blocks (compile.enabled) and keeps ZeRO's hooks eager")
_DEEPCOMPILE_DEFAULTS = {  # deepspeed/compile/config.py's other fields, at DeepSpeed's defaults
    "autoep_non_moe": False, "free_activation": False, "free_activation_threshold": 10 * 1024 * 1024,
    "offload_activation": False, "offload_activation_pin_memory": True, "offload_opt_states": False,
    "double_buffer": True, "symmetric_memory": False, "debug_log": False, "offload_parameters": False,
    "sync_before_reduce": False, "sync_after_reduce": False, "sync_before_allgather": False,
    "sync_after_allgather": False, "keep_int_input_tensors": True, "keep_all_input_tensors": False, "passes": None}
ZO = "zero_optimization."
AC = "activation_checkpointing."

KEYS: tuple[Key, ...] = (
    # --- batch, optimizer, schedule, clipping (fields of EngineConfig)
    _h("train_batch_size", "global batch in rows = micro x accumulation x data-parallel size"),
    _h("train_micro_batch_size_per_gpu", "rows per rank per forward/backward"),
    _h("gradient_accumulation_steps", "micro-batches per optimizer step"),
    _h("optimizer.type", "AdamW, Adam or SGD (other types: see below)"),
    _h("optimizer.params.lr", "learning rate (the schedule's base)"),
    _h("optimizer.params.betas", "Adam(W) betas"),
    _h("optimizer.params.eps", "Adam(W) eps"),
    _h("optimizer.params.weight_decay", "Adam: decoupled (AdamW) unless adam_w_mode is false, as in DeepSpeed"),
    _h("optimizer.params.adam_w_mode", "type Adam only: true (default) = decoupled weight decay"),
    _h("optimizer.params.momentum", "SGD momentum"),
    _h("optimizer.params.nesterov", "SGD Nesterov momentum"),
    _n("optimizer.params.torch_adam", "DeepSpeed picks torch's Adam over its fused one; tinyscale always "
       "uses torch's optimizers", _is(True), _TRUE),
    _r("optimizer.params.bias_correction", "DeepSpeed's fused Adam can skip Adam's bias correction; torch's "
       "Adam always applies it", _is(True), _TRUE),
    _h("scheduler.type", "WarmupLR, WarmupDecayLR, WarmupCosineLR (LRRangeTest, OneCycle: refused)"),
    _h("scheduler.params.warmup_min_lr", "start of the warm-up, and WarmupDecayLR's floor (default 0)"),
    _h("scheduler.params.warmup_max_lr", "peak (default: WarmupLR the optimizer's lr, WarmupDecayLR 0.001; "
                                          "\"auto\": optimizer.params.lr)"),
    _h("scheduler.params.warmup_num_steps", "warm-up length (default 1000; at least 1, and 1 means 2, as "
                                             "DeepSpeed clamps it)"),
    _h("scheduler.params.warmup_type", "\"log\" (default) or \"linear\""),
    _h("scheduler.params.total_num_steps", "end of the decay (WarmupDecayLR, WarmupCosineLR)"),
    _h("scheduler.params.warmup_min_ratio", "WarmupCosineLR: warm-up start as a fraction of lr (default 0)"),
    _h("scheduler.params.cos_min_ratio", "WarmupCosineLR: floor as a fraction of lr (default 0.0001)"),
    _r("scheduler.params.last_batch_iteration", "DeepSpeed starts the schedule after this step; tinyscale's "
       "schedule follows the engine's step, which load_checkpoint restores", _is(-1), "-1"),
    _h("gradient_clipping", "clip the global gradient norm to this (0: off)"),
    _h("prescale_gradients", "true: divide the gradients by the data-parallel size before their sum; false: by "
       "gradient_predivide_factor before and dp / factor after (DeepSpeed's default, false); null here: true, "
       "as torch's DDP (an fp16 sum cannot overflow), unless gradient_predivide_factor is set"),
    _h("gradient_predivide_factor", "with prescale_gradients false: divide by this before the sum and by "
       "dp / factor after (default 1.0: sum, then divide); with true: noted"),
    _h("communication_data_type", "gradients are cast to fp32, fp16 or bf16 for their reduction (16-bit: half "
       "the bytes of fp32): stage 0's buckets, cast back after the all-reduce; ZeRO 1-3's reduce-scatter, the "
       "sum added into the shard in its own dtype; null: the gradients' dtype"),
    _r("sparse_gradients", "DeepSpeed reduces nn.Embedding's sparse gradients as sparse tensors; tinyscale's "
       "gradients are dense", _is(False), _FALSE),
    _r("data_types", "DeepSpeed can accumulate gradients in another dtype (grad_accum_dtype); tinyscale "
       "accumulates in the gradients' dtype", lambda v, _: v is None or isinstance(v, dict) and v.get("grad_accum_dtype") is None,
       "grad_accum_dtype null"),
    _r("dataloader_drop_last", "DeepSpeed builds the data loader; tinyscale's engine takes global batches",
       _is(False), _FALSE),
    # --- precision
    _h("fp16.enabled", "fp16 compute, fp32 masters, loss scaling"),
    _h("fp16.loss_scale", "0: dynamic; > 0: static scale"),
    _h("fp16.initial_scale_power", "first dynamic scale 2**power"),
    _h("fp16.loss_scale_window", "clean steps before the scale doubles"),
    _h("fp16.hysteresis", "overflows tolerated before the scale halves"),
    _h("fp16.consecutive_hysteresis", "a clean step restores the whole hysteresis"),
    _h("fp16.min_loss_scale", "floor of the dynamic scale"),
    _r("fp16.auto_cast", "DeepSpeed casts the model's floating-point inputs to fp16; tinyscale passes "
       "inputs as given", _is(False), _FALSE),
    _r("fp16.fp16_master_weights_and_grads", "DeepSpeed can keep the masters in fp16; tinyscale's masters "
       "are fp32", _is(False), _FALSE),
    _h("bf16.enabled", "bf16 compute, fp32 masters"),
    _r("amp", "NVIDIA Apex AMP; use fp16 or bf16", _disabled, _OFF),
    # --- ZeRO
    _h(ZO + "stage", "0, 1, 2, 3"),
    _h(ZO + "reduce_bucket_size", "elements per gradient reduction at stages 0-2 (stage 0 with overlap_comm: "
       "the first bucket closing once it reaches 1 MiB, torch DDP's layout; stage 3: one unit at a time, noted)"),
    _h(ZO + "overlap_comm", "stages 0-2: reduce during (the last) backward; stage 3: prefetch the next unit"),
    _h(ZO + "allgather_bucket_size", "stages 1-2: no all-gather of the updated parameters moves more than this "
       "many elements (each rank's shard in pieces of size // dp); stages 0 and 3: noted"),
    _r(ZO + "allgather_partitions", "DeepSpeed can broadcast each rank's partition in turn; tinyscale "
       "all-gathers", _is(True), _TRUE),
    _h(ZO + "reduce_scatter", "stages 1-2: false all-reduces each unit's gradients and keeps this rank's slice "
       "(twice the bytes); stage 3 always reduce-scatters, as in DeepSpeed (false is noted)"),
    _n(ZO + "contiguous_gradients", "DeepSpeed copies gradients into one contiguous buffer; tinyscale's flat "
       "buffers are always contiguous", _is(True), _TRUE),
    _r(ZO + "load_from_fp32_weights", "DeepSpeed can rebuild the fp32 masters from 16-bit weights on load; "
       "tinyscale's checkpoints always restore the fp32 masters", _is(True), _TRUE),
    _n(ZO + "grad_hooks", "DeepSpeed's stage 1 can reduce from gradient hooks; tinyscale's stage 1 reduces "
       "after backward", _is(True), _TRUE),
    _n(ZO + "round_robin_gradients", "DeepSpeed spreads offloaded gradient copies over ranks (speed only); "
       "tinyscale copies each rank's shard", _is(False), _FALSE),
    _r(ZO + "ignore_unused_parameters", "DeepSpeed can raise on a parameter with no gradient; tinyscale "
       "trains unused parameters as one process does", _is(True), _TRUE),
    _n(ZO + "elastic_checkpoint", "tinyscale's checkpoints always load across layouts", _never),
    _h(ZO + "sub_group_size", "stages 1-3: the optimizer steps each rank's shard in sub-groups of at most this "
       "many elements, so the step's temporaries (and, offloaded, the gradient copied to the host) are one "
       "sub-group's; training unchanged (default 1e9, DeepSpeed's; \"auto\": 1e9; stage 0: noted)"),
    _h(ZO + "stage3_max_live_parameters", "stage 3: a prefetch waits while it would take the gathered elements "
       "(units in use, prefetched ones, padding included) above this many; units needed now are gathered "
       "regardless (default 1e9, DeepSpeed's; stages 0-2: noted)"),
    _n(ZO + "stage3_max_reuse_distance", "DeepSpeed keeps a gathered parameter reused this soon; tinyscale "
       "frees each unit after use and gathers it again for backward"),
    _h(ZO + "stage3_prefetch_bucket_size", "stage 3: units ahead are prefetched while fewer than this many "
       "elements are in flight (0: none; default null: one unit, DeepSpeed's 5e7; \"auto\": null; stages 0-2: "
       "noted)"),
    _h(ZO + "stage3_param_persistence_threshold", "stage 3: parameters with fewer elements stay whole on every "
       "rank, never gathered in forward or backward; their optimizer state stays sharded and one all-gather per "
       "step updates them (default 0 here, DeepSpeed's 1e5; \"auto\": 0; stages 0-2: noted)"),
    _n(ZO + "stage3_gather_16bit_weights_on_model_save", "engine.full_state_dict() always gathers full weights",
       _is(False), _FALSE),
    _n(ZO + "stage3_gather_fp16_weights_on_model_save", "old name of stage3_gather_16bit_weights_on_model_save",
       _is(False), _FALSE),
    _n(ZO + "memory_efficient_linear", "DeepSpeed's stage 3 swaps in its own linear function; tinyscale leaves "
       "the model's layers alone", _is(True), _TRUE),
    _n(ZO + "log_trace_cache_warnings", "DeepSpeed's stage-3 trace diagnostics", _is(False), _FALSE),
    _n(ZO + "use_multi_rank_bucket_allreduce", "a DeepSpeed all-reduce variant (speed only)", _is(True), _TRUE),
    _r(ZO + "cpu_offload", "DeepSpeed's old spelling: use offload_optimizer.device \"cpu\"", _is(False), _FALSE),
    _r(ZO + "zero_hpz_partition_size", "ZeRO++ hierarchical partitioning (a second copy of parameters per "
       "node); not built", _is(1), "1"),
    _r(ZO + "zero_quantized_weights", "ZeRO++ quantized all-gather; not built", _is(False), _FALSE),
    _r(ZO + "zero_quantized_gradients", "ZeRO++ quantized reduce-scatter; not built", _is(False), _FALSE),
    _r(ZO + "mics_shard_size", "MiCS: shard within groups of this size, replicate across; not built",
       _is(-1), "-1"),
    _r(ZO + "mics_hierarchical_params_gather", "MiCS's two-level gather; not built", _is(False), _FALSE),
    _h(ZO + "offload_optimizer.device", "none, cpu, nvme (stage >= 1)"),
    _h(ZO + "offload_optimizer.nvme_path", "directory of the swap files"),
    _h(ZO + "offload_optimizer.pin_memory", "device cpu with a GPU: the host tier's master shards are allocated "
       "pinned (page-locked), for faster host-device copies; without a GPU, or with nvme: noted at start-up"),
    _h(ZO + "offload_param.device", "none, cpu, nvme (stage 3)"),
    _h(ZO + "offload_param.nvme_path", "directory of the swap files"),
    _h(ZO + "offload_param.pin_memory", "device cpu with a GPU: the host tier's parameter shards are allocated "
       "pinned (page-locked), for faster host-device copies; without a GPU, or with nvme: noted at start-up"),
    *(_n(ZO + f"{section}.{key}", "DeepSpeed's asynchronous-I/O buffers for NVMe; tinyscale reads and writes "
         "each shard with one file operation")
      for section, key in (("offload_optimizer", "buffer_count"), ("offload_optimizer", "pipeline_read"),
                           ("offload_optimizer", "pipeline_write"), ("offload_optimizer", "fast_init"),
                           ("offload_param", "buffer_count"), ("offload_param", "buffer_size"),
                           ("offload_param", "max_in_cpu"))),
    _r(ZO + "offload_optimizer.ratio", "DeepSpeed can run a fraction of the optimizer step on the host; "
       "tinyscale offloads all of it", _is(1, 1.0), "1.0"),
    # --- activation checkpointing (DeepSpeed's keys configure its checkpoint(); ours pick a policy)
    _h(AC + "partition_activations", "each checkpointed block's input kept split over the tensor-parallel "
       "group and all-gathered for the rerun (policy full or every_k, parallel.tensor > 1 without "
       "sequence_parallel; tinyscale.checkpointing.saved_inputs)"),
    _h(AC + "cpu_checkpointing", "the checkpoints (each checkpoint's saved inputs, or their partitions) kept in "
       "host memory (policy full, every_k or selective); policy \"offload\" moves every saved tensor instead"),
    _n(AC + "contiguous_memory_optimization", "DeepSpeed copies checkpoints into one buffer; tinyscale leaves "
       "them to the allocator", _is(False), _FALSE),
    _n(AC + "number_checkpoints", "sizes DeepSpeed's contiguous checkpoint buffer", _is(None), "null"),
    _n(AC + "synchronize_checkpoint_boundary", "DeepSpeed synchronises the device at checkpoints (timing "
       "only)", _is(False), _FALSE),
    _n(AC + "profile", "DeepSpeed times checkpointed forwards; use wall_clock_breakdown", _is(False), _FALSE),
    # --- logging, profiling, monitors
    _h("steps_per_print", "log step, loss, lr (and loss scale) every this many steps (logger "
       "tinyscale.engine, INFO, rank 0)"),
    _h("wall_clock_breakdown", "per-step forward/backward/optimizer/communication times (engine.profiler)"),
    _n("flops_profiler", "DeepSpeed profiles one step's FLOPs per module; tinyscale reports MFU every step "
       "(engine.last_step)", _disabled, _OFF),
    _h("tensorboard.enabled", "event files of loss, lr, loss scale, grad norm, tokens/s, MFU, memory and health "
       "counts, every step (tinyscale.engine.monitor)"),
    _h("tensorboard.output_path", "the event files go to output_path/job_name/ ('': the working directory)"),
    _h("tensorboard.job_name", "the run's folder under output_path"),
    _n("wandb", _MONITOR.format("Weights & Biases"), _disabled, _OFF),
    _h("csv_monitor.enabled", "one CSV file per metric (rows: step, value), DeepSpeed's layout "
       "(tinyscale.engine.monitor)"),
    _h("csv_monitor.output_path", "the CSV files go to output_path/job_name/ ('': the working directory)"),
    _h("csv_monitor.job_name", "the run's folder under output_path"),
    _n("comet", _MONITOR.format("Comet"), _disabled, _OFF),
    _n("comms_logger", "tinyscale records every collective in engine.comm_ledger", _disabled, _OFF),
    _n("timers", "DeepSpeed's throughput timers; tinyscale's are in engine.last_step", _never),
    _n("memory_breakdown", "DeepSpeed logs memory at points of the step; use engine.memory_report()",
       _is(False), _FALSE),
    _n("dump_state", "DeepSpeed prints its state after start-up; print engine.config", _is(False), _FALSE),
    _n("zero_allow_untested_optimizer", "DeepSpeed refuses untested optimizers with ZeRO; tinyscale checks "
       "that the optimizer's state is elementwise instead", _is(False), _FALSE),
    _n("zero_force_ds_cpu_optimizer", "DeepSpeed insists on its CPU Adam with offload; tinyscale runs the "
       "configured torch optimizer on the host", _is(False), _FALSE),
    _n("checkpoint", "DeepSpeed's checkpoint-file options; tinyscale has one format that loads across layouts",
       _never),
    _n("aio", "DeepSpeed's asynchronous-I/O settings for NVMe; tinyscale uses plain file reads and writes",
       _never),
    _n("nebula", "DeepSpeed's asynchronous checkpoint service", _disabled, _OFF),
    # --- compile: tinyscale's enabled; backend and compile_kwargs as DeepSpeed's engine.compile(...) names them
    _h("compile.enabled", "tinyscale's own: torch.compile each GPT block (engine/compiled.py); DeepSpeed compiles "
       "when the script calls engine.compile(), which tinyscale.deepspeed's engine has too. With a checkpointing "
       "policy, refused: partition_activations and cpu_checkpointing (saved-tensor hooks, not traced), full and "
       "every_k under tp, cp or an MoE GPT (graph breaks inside the region), tp's tracker dropout"),
    _h("compile.backend", "torch.compile's backend (DeepSpeed's engine.compile(backend=...)): inductor, aot_eager "
       "or eager"),
    _h("compile.compile_kwargs", "torch.compile's mode, dynamic, fullgraph and options (DeepSpeed's "
       "engine.compile(compile_kwargs=...))"),
    _n("compile.deepcompile", _DEEPCOMPILE, _is(False), _FALSE),
    *(_n("compile." + name, "a DeepCompile option (see compile.deepcompile)", _is(default), json.dumps(default))
      for name, default in _DEEPCOMPILE_DEFAULTS.items()),
    _r("autotuning", "DeepSpeed's autotuner launches trial runs to pick a layout; tinyscale's is a command of "
       "its own, tinyscale autotune --config (lesson 12)", _disabled, _OFF),
    # --- other topics
    _r("pipeline", "DeepSpeed's pipeline engine; tinyscale's pipeline is parallel.pipeline, "
       "parallel.pipeline_schedule and parallel.virtual_stages", _never),
    _h("tensor_parallel.autotp_size", "AutoTP's degree: becomes parallel.tensor (0, DeepSpeed's default, and 1: "
       "off); tinyscale's GPT is split by its own plan (lesson 07), another model by AutoTP's names or "
       "parallel.tp_plan (lesson 12)", field="parallel.tensor"),
    _r("tensor_parallel", "DeepSpeed's AutoTP settings other than autotp_size (tp_overlap_comm, dtype, "
       "partition_config, ...); tinyscale's tensor parallelism is parallel.tensor (which autotp_size sets), "
       "its GPT by its own plan (lesson 07), another model by AutoTP with parallel.tp_plan (lesson 12)", _never),
    _r("elasticity", "DeepSpeed picked a batch valid for a range of world sizes (DeepSpeed 0.19.8 has removed it); "
       "tinyscale.recovery.elastic_world_sizes lists the world sizes a fixed batch allows", _disabled, _OFF),
    _r("disable_allgather", "DeepSpeed can broadcast instead of all-gather; tinyscale all-gathers",
       _is(False), _FALSE),
    *(_r(name, _NOT_BUILT, _disabled, _OFF) for name in (
        "sparse_attention", "compression_training", "data_efficiency", "curriculum_learning",
        "progressive_layer_drop", "eigenvalue", "quantize_training", "weight_quantization", "hybrid_engine")),
)
BY_PATH = {k.path: k for k in KEYS}

# DeepSpeed's optimizer and scheduler types that tinyscale's config does not build, and why.
_OWN_OPTIMIZER = "pass it as your own optimizer: ts.initialize(model, config, optimizer=...)"
OTHER_TYPES = {
    "optimizer.type": {
        "lamb": "LAMB scales each tensor's update by a trust ratio of whole-tensor norms, which ZeRO's "
                f"pieces do not have; at stage 0 {_OWN_OPTIMIZER}",
        "onebitadam": "tinyscale's 1-bit Adam is a compression type: set optimizer.type \"AdamW\" (its params "
                      "are used) and compression: {\"type\": \"onebit_adam\", \"freeze_step\": N} (lesson 10)",
        "zerooneadam": "0/1 Adam is not built; the nearest is compression.type \"onebit_adam\" (lesson 10)",
        "onebitlamb": "1-bit LAMB is not built (LAMB's whole-tensor trust ratio); the nearest is compression.type "
                      "\"onebit_adam\" (lesson 10)",
        "adagrad": f"not one of the config's optimizers; {_OWN_OPTIMIZER} (torch.optim.Adagrad)",
        "lion": f"not one of the config's optimizers; {_OWN_OPTIMIZER}",
        "muadam": "muP's Adam rescales per-layer learning rates from the model's widths; not built",
        "muadamw": "muP's AdamW rescales per-layer learning rates from the model's widths; not built",
        "musgd": "muP's SGD rescales per-layer learning rates from the model's widths; not built",
    },
    "scheduler.type": {
        "lrrangetest": "the learning-rate range test (grow the lr until training diverges) is not built",
        "onecycle": "the one-cycle policy (lr and momentum cycles) is not built",
    },
}
