"""Combinations a parallel layout refuses until a test covers them, worded alike for every layout.

Each layout's `check_config` (tensor parallelism in `engine/parallelize.py`, context parallelism
in `engine/context.py`, pipeline parallelism in `engine/pipeline_layout.py`) adds these to its own
refusals; `engine.check_supported` raises them all in one `ConfigError` before any process group
exists. `check_degree` is the first check of a layout's `check_layout` (context, pipeline).
"""

from __future__ import annotations

from tinyscale.config import ConfigError, EngineConfig
from tinyscale.models.gpt import GPT


def untested_combinations(config: EngineConfig, setting: str, topic: str) -> list[str]:
    """Activation checkpointing and offload with `setting` (e.g. "parallel.tensor=2"), each with
    its fix: no test covers them with `topic` (e.g. "tensor parallelism") yet. (fp16/bf16 are
    served in every layout: tests/engine/test_layout_mixed_precision.py.)"""
    problems = []
    policy = config.activation_checkpointing.policy
    if policy != "none":
        problems.append(f"activation_checkpointing.policy={policy!r} with {setting} (not tested yet); "
                        "use policy \"none\"")
    zero = config.zero_optimization
    if zero.offload_optimizer.device != "none" or zero.offload_param.device != "none":
        problems.append(f"zero_optimization offload with {setting} (not tested yet); use offload device \"none\"")
    return problems


def check_degree(model, mesh, *, axis: str, field: str, degree: int, action: str) -> bool:
    """A mesh passed to initialize has `degree` ranks on `axis` (the config's `field`), and a
    degree > 1 is given tinyscale's GPT (`action`: what the layout does to it); False when
    `degree` is 1 (nothing more to check), before any collective."""
    if mesh is not None and mesh.size(axis) != degree:
        raise ConfigError(f"{field}={degree} but the mesh passed to initialize has {axis}={mesh.size(axis)}: "
                          "make them equal (or pass no mesh)")
    if degree == 1:
        return False
    if not isinstance(model, GPT):
        raise ConfigError(f"{field}={degree}: {action}, not a {type(model).__name__}; use {field} 1 for this model")
    return True
