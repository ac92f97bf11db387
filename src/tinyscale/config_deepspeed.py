"""Read a DeepSpeed config as DeepSpeed means it: resolve ``"auto"``, apply the table of keys.

`screen(raw)` runs before `EngineConfig` validates a raw dict: it resolves ``"auto"`` values,
takes out the keys the table (`tinyscale.deepspeed_keys.KEYS`) notes or accepts as meaning
what tinyscale does, and collects a reason for every key it refuses. What remains is
validated by `EngineConfig`, where a misspelt key is still "unknown key; did you mean ...".
`runtime_notes` adds the notes that depend on the machine (pin_memory without a GPU).
The table, for readers: docs/deepspeed-config.md. Tests: ``pytest -k deepspeed_config``.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

from tinyscale.deepspeed_keys import KEYS, OTHER_TYPES
from tinyscale.dist.runtime import rank

# --8<-- [start:auto]
# "auto" as Hugging Face's integration writes it. HF fills these from TrainingArguments; here
# there are no TrainingArguments, so each resolves from the rest of the config where it can,
# to the value HF's defaults give where those are tinyscale's, and is refused where only you know.
_DERIVED = "derived from the other batch sizes (train_batch_size = micro x accumulation x dp)"
_DEFAULT = "tinyscale's default, which is HF's TrainingArguments default too"
AUTO: dict[str, tuple[str, Any]] = {
    # path: ("drop", why) leaves the key out (derived or default); ("set", value); ("refuse", what to set)
    "train_batch_size": ("drop", _DERIVED),
    "train_micro_batch_size_per_gpu": ("drop", _DERIVED),
    "gradient_accumulation_steps": ("drop", _DERIVED),
    "optimizer.params.betas": ("drop", _DEFAULT),
    "optimizer.params.eps": ("drop", _DEFAULT),
    "optimizer.params.weight_decay": ("drop", _DEFAULT),
    "optimizer.params.lr": ("refuse", "HF takes it from --learning_rate; set optimizer.params.lr"),
    "scheduler.params.warmup_min_lr": ("set", 0.0),
    "scheduler.params.warmup_max_lr": ("set", "optimizer.params.lr"),
    "scheduler.params.warmup_num_steps": ("refuse", "HF takes it from --warmup_steps or --warmup_ratio; set "
                                                    "scheduler.params.warmup_num_steps"),
    "scheduler.params.total_num_steps": ("refuse", "HF takes it from the run's length; set "
                                                   "scheduler.params.total_num_steps (optimizer steps)"),
    "gradient_clipping": ("set", 1.0),  # HF's default max_grad_norm
    "fp16.enabled": ("set", False),  # HF's default: no --fp16
    "bf16.enabled": ("set", False),
    "amp.enabled": ("set", False),
    "zero_optimization.reduce_bucket_size": ("drop", _DEFAULT),
    # noted keys (no effect here) may say "auto" too; the table takes them out
    # HF writes 0.9 x hidden size squared, which needs the model: here tinyscale's default (one unit ahead)
    "zero_optimization.stage3_prefetch_bucket_size": ("drop", "one unit ahead, tinyscale's default"),
    # HF writes 10 x hidden size, which needs the model: here tinyscale's default (0, every parameter sharded)
    "zero_optimization.stage3_param_persistence_threshold": ("drop", "0, tinyscale's default"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": ("keep", None),
    "zero_optimization.sub_group_size": ("drop", "1e9, DeepSpeed's default and tinyscale's"),
}
# --8<-- [end:auto]
_DEFAULT_LR = 1e-3  # OptimizerParams.lr's default (an "auto" warmup_max_lr follows the config's lr)


def _leaves(d: dict, prefix: str = ""):
    for key, value in d.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _leaves(value, path + ".")
        else:
            yield path, d, key, value


def _section(raw: dict, path: str) -> dict | None:
    for part in path.split(".")[:-1]:
        raw = raw.get(part) if isinstance(raw, dict) else None
    return raw if isinstance(raw, dict) else None


def resolve_auto(raw: dict, errors: list[str]) -> None:
    """Replace each "auto" in `raw` (in place) by its resolution, or add why it cannot be."""
    lr = (raw.get("optimizer") or {}).get("params", {}).get("lr", _DEFAULT_LR)
    for path, section, key, value in list(_leaves(raw)):
        if value != "auto":
            continue
        action, what = AUTO.get(path, ("refuse", None))
        if action == "drop":
            del section[key]
        elif action == "set":
            section[key] = lr if what == "optimizer.params.lr" else what
            if what == "optimizer.params.lr" and lr == "auto":
                errors.append(f"config field '{path}': \"auto\" follows optimizer.params.lr, itself \"auto\"; "
                              "set optimizer.params.lr")
        elif action == "refuse":
            del section[key]  # reported here, not again by validation
            errors.append(f"config field '{path}': \"auto\" cannot be resolved here: "
                          f"{what or 'tinyscale resolves auto only where HF integration does; set a value'}")


def _check_types(raw: dict, errors: list[str]) -> None:
    for path, refused in OTHER_TYPES.items():
        section = _section(raw, path)
        kind = section.get("type") if section is not None else None
        if isinstance(kind, str) and kind.lower() in refused:
            errors.append(f"config field '{path}': DeepSpeed's {kind} is refused: {refused[kind.lower()]}")
            del section["type"]


def _autotp(raw: dict, errors: list[str]) -> None:
    """tensor_parallel.autotp_size (DeepSpeed's AutoTP degree; 0, its default, is off) becomes
    parallel.tensor: tensor parallelism over that many ranks, dp = world / it, as in DeepSpeed."""
    section = raw.get("tensor_parallel")
    if not isinstance(section, dict) or "autotp_size" not in section:
        return
    size = section.pop("autotp_size")
    if not section:
        del raw["tensor_parallel"]
    if type(size) is not int or size < 0:
        errors.append(f"config field 'tensor_parallel.autotp_size' = {json.dumps(size, default=str)}: "
                      "an integer >= 0 (0 or 1: no tensor parallelism)")
        return
    parallel = raw.get("parallel", {})
    tensor = parallel.get("tensor", 1) if isinstance(parallel, dict) else None
    if size > 1 and tensor not in (1, size):
        errors.append(f"config field 'tensor_parallel.autotp_size' = {size} and parallel.tensor = "
                      f"{json.dumps(tensor, default=str)} disagree: both set the tensor-parallel degree; keep one")
    elif size > 1:
        raw["parallel"] = {**parallel, "tensor": size}


def screen(raw: dict) -> tuple[dict, list[str], list[str]]:
    """(what EngineConfig validates, notes to log at start-up, reasons for refusal) for `raw`."""
    clean = copy.deepcopy(raw)
    notes: list[str] = []
    errors: list[str] = []
    resolve_auto(clean, errors)
    _check_types(clean, errors)
    _autotp(clean, errors)
    for key in KEYS:
        if key.kind == "honoured":
            continue
        section = _section(clean, key.path)
        name = key.path.rsplit(".", 1)[-1]
        if section is None or name not in section:
            continue
        value = section[name]
        shown = json.dumps(value, default=str)
        if key.same(value, section):
            del section[name]  # means what tinyscale does
        elif key.kind == "noted":
            notes.append(f"{key.path} = {shown}: no effect here. {key.why}")
            del section[name]
        else:
            errors.append(f"config field '{key.path}' = {shown} is refused: {key.why}"
                          + (f" (accepted: {key.same_doc})" if key.same_doc else ""))
            del section[name]
    return clean, notes, errors


def gradient_scaling(config) -> tuple[bool, float]:
    """(prescale_gradients, gradient_predivide_factor) with DeepSpeed's meaning. tinyscale
    prescales by default (divide by dp before the sum, as torch's DDP: an fp16 sum cannot
    overflow); a config that sets gradient_predivide_factor alone gets DeepSpeed's default,
    false, without which the factor means nothing."""
    prescale = config.prescale_gradients
    if prescale is None:
        prescale = "gradient_predivide_factor" not in config.model_fields_set
    return prescale, config.gradient_predivide_factor


def runtime_notes(config, *, has_gpu: bool) -> list[str]:
    """Notes that depend on the machine and the resolved config (logged with `screen`'s)."""
    notes = []
    zero = config.zero_optimization
    for name in ("offload_optimizer", "offload_param"):
        section = getattr(zero, name)
        why = ("no effect without a GPU: pinning speeds host-device copies, and there are none" if not has_gpu
               else "no effect: nothing is offloaded" if section.device == "none"
               else "no effect with nvme: the disk tier frees and refills its host buffers, which pinned "
                    "memory cannot do" if section.device == "nvme" else None)
        if section.pin_memory and why:  # else honoured: the host tier's buffers are pinned (zero/offload.py)
            notes.append(f"zero_optimization.{name}.pin_memory = True: {why}")
    if gradient_scaling(config)[0] and config.gradient_predivide_factor != 1.0:
        notes.append("gradient_predivide_factor: no effect with prescale_gradients true, which divides by the "
                     "data-parallel size before the sum (DeepSpeed reads the factor only when it is false)")
    if zero.stage == 3 and not zero.reduce_scatter:
        notes.append("zero_optimization.reduce_scatter = false: no effect at stage 3, which always "
                     "reduce-scatters (DeepSpeed's stage 3 too)")
    if zero.stage != 3 and zero.stage3_param_persistence_threshold:
        notes.append("zero_optimization.stage3_param_persistence_threshold: no effect at stages 0-2, whose "
                     "parameters are always whole on every rank")
    if zero.stage in (0, 3) and "allgather_bucket_size" in zero.model_fields_set:
        notes.append("zero_optimization.allgather_bucket_size: no effect at stages 0 and 3 (DeepSpeed reads it "
                     "at stages 1-2, which all-gather the updated parameters after the step)")
    for name in ("stage3_prefetch_bucket_size", "stage3_max_live_parameters"):
        if zero.stage != 3 and name in zero.model_fields_set:
            notes.append(f"zero_optimization.{name}: no effect at stages 0-2, which never gather parameters "
                         "ahead of use (stage 3's prefetch)")
    if zero.stage == 0 and "sub_group_size" in zero.model_fields_set:
        notes.append("zero_optimization.sub_group_size: no effect at stage 0, whose optimizer is not sharded "
                     "(ZeRO stages 1-3 step their shards in sub-groups)")
    if zero.stage == 3 and "reduce_bucket_size" in zero.model_fields_set:
        notes.append("zero_optimization.reduce_bucket_size: no effect at stage 3, which reduce-scatters each "
                     "unit's gradients in one call when backward leaves the unit (the units: zero3_wrap)")
    return notes



def log_notes(notes) -> None:
    """Say each note once, at start-up, on rank 0 (logger ``tinyscale.config``, WARNING)."""
    if notes and rank() == 0:
        logging.getLogger("tinyscale.config").warning(
            "config: %d DeepSpeed key(s) accepted with no effect here:\n  %s", len(notes), "\n  ".join(notes))
