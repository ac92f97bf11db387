"""DS-38's grid (benchmarks/stacking.py): every combination of accumulation, precision,
checkpointing and ZeRO stage, once, each a valid engine config with the same global batch.

    pytest -k stacking_grid
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import tinyscale as ts

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("stacking", ROOT / "benchmarks/stacking.py")
stacking = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stacking)


def test_stacking_grid_covers_every_combination_with_the_same_global_batch():
    combos = stacking.combos()
    assert len({tuple(sorted(c.items())) for c in combos}) == len(combos) == 2 * 2 * 2 * 4
    for combo in combos:
        config = ts.EngineConfig.load(stacking.engine_config(combo))
        assert config.batch(2).train_batch_size == 2 * stacking.GLOBAL_ROWS_PER_RANK  # same rows at world size 2
        assert config.gradient_accumulation_steps == combo["accum"]
        assert config.bf16.enabled == (combo["precision"] == "bf16")
        assert config.activation_checkpointing.policy == combo["ckpt"]
        assert config.zero_optimization.stage == combo["stage"]
