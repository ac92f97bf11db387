"""Combinations a parallel layout refuses until a test covers them, worded alike for every layout.

Each layout's `check_config` (tensor parallelism in `engine/parallelize.py`, context parallelism
in `engine/context.py`) adds these to its own refusals; `engine.check_supported` raises them
all in one `ConfigError` before any process group exists.
"""

from __future__ import annotations

from tinyscale.config import EngineConfig


def untested_combinations(config: EngineConfig, setting: str, topic: str) -> list[str]:
    """fp16/bf16, activation checkpointing and offload with `setting` (e.g. "parallel.tensor=2"),
    each with its fix: no test covers them with `topic` (e.g. "tensor parallelism") yet."""
    problems = []
    for section in ("fp16", "bf16"):
        if getattr(config, section).enabled:
            problems.append(f"{section}.enabled with {setting} (mixed precision with {topic} is not tested yet); "
                            "use float32/float64 parameters")
    policy = config.activation_checkpointing.policy
    if policy != "none":
        problems.append(f"activation_checkpointing.policy={policy!r} with {setting} (not tested yet); "
                        "use policy \"none\"")
    zero = config.zero_optimization
    if zero.offload_optimizer.device != "none" or zero.offload_param.device != "none":
        problems.append(f"zero_optimization offload with {setting} (not tested yet); use offload device \"none\"")
    return problems
