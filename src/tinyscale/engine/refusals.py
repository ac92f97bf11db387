"""Combinations a parallel layout refuses until a test covers them, worded alike for every layout.

Activation checkpointing and ZeRO offload left this list in issue 25: every layout serves them
(tests/engine/test_layout_activation_checkpointing.py, test_layout_offload.py).

Each layout's `check_config` (tensor parallelism in `engine/parallelize.py`, context parallelism
in `engine/context.py`, pipeline parallelism in `engine/pipeline_layout.py`) adds these to its own
refusals; `engine.check_supported` raises them all in one `ConfigError` before any process group
exists. `check_degree` is the first check of a layout's `check_layout` (context, pipeline).
"""

from __future__ import annotations

from tinyscale.config import ConfigError, EngineConfig
from tinyscale.models.gpt import GPT


def untested_combinations(config: EngineConfig, setting: str, topic: str) -> list[str]:
    """fp16/bf16 with `setting` (e.g. "parallel.tensor=2"), with its fix: no test covers it with
    `topic` (e.g. "tensor parallelism") yet. (Activation checkpointing and ZeRO offload are served
    in every layout: tests/engine/test_layout_activation_checkpointing.py, test_layout_offload.py.)"""
    problems = []
    for section in ("fp16", "bf16"):
        if getattr(config, section).enabled:
            problems.append(f"{section}.enabled with {setting} (mixed precision with {topic} is not tested yet); "
                            "use float32/float64 parameters")
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
