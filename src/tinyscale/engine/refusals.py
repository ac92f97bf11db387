"""`check_degree`: the first check of a layout's `check_layout` (context, pipeline), worded alike.

The list of "not tested yet" combinations that lived here is gone (issue 25): fp16/bf16,
activation checkpointing and ZeRO offload are served in every layout
(tests/engine/test_layout_mixed_precision.py, test_layout_activation_checkpointing.py,
test_layout_offload.py). What a layout still refuses, it refuses in its own `check_config` or
`check_layout` with the reason in principle; `engine/plan.py` runs them all in one pass.
"""

from __future__ import annotations

from tinyscale.config import ConfigError
from tinyscale.models.gpt import GPT


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
