"""EngineConfig: DeepSpeed key names, the batch identity, and errors that name the field and the fix."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tinyscale import ConfigError, EngineConfig
from tinyscale.engine.engine import check_supported


def test_config_accepts_a_deepspeed_style_dict():
    cfg = EngineConfig.load({
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "adamw", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0},
        "fp16": {"enabled": False},
    })
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.params.betas == (0.9, 0.95)
    assert cfg.batch(dp=4).train_batch_size == 32


def test_config_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"'zero_optimisation': unknown key; did you mean 'zero_optimization'"):
        EngineConfig.load({"train_batch_size": 8, "zero_optimisation": {"stage": 1}})
    with pytest.raises(ConfigError, match=r"'optimizer.params.learning_rate': unknown key"):
        EngineConfig.load({"train_batch_size": 8, "optimizer": {"params": {"learning_rate": 1}}})


@pytest.mark.parametrize("bad, field", [
    ({"optimizer": {"params": {"lr": -1}}}, "optimizer.params.lr"),
    ({"optimizer": {"type": "Lion"}}, "optimizer.type"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
    ({"gradient_clipping": -0.5}, "gradient_clipping"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu"),
    ({"parallel": {"tensor": 0}}, "parallel.tensor"),
    ({"optimizer": {"params": {"betas": [0.9, 1.5]}}}, "optimizer.params.betas"),
])
def test_config_impossible_values_name_the_field(bad, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        EngineConfig.load({"train_batch_size": 8, **bad})


def test_config_cross_field_rules():
    with pytest.raises(ConfigError, match="enable at most one"):
        EngineConfig.load({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match="set train_batch_size"):
        EngineConfig.load({"gradient_accumulation_steps": 2})
    with pytest.raises(ConfigError, match="momentum/nesterov apply to SGD only"):
        EngineConfig.load({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"momentum": 0.9}}})
    with pytest.raises(ConfigError, match="needs params.total_num_steps"):
        EngineConfig.load({"train_batch_size": 8, "scheduler": {"type": "WarmupCosineLR"}})


@given(micro=st.integers(1, 8), accum=st.integers(1, 8), dp=st.integers(1, 8))
def test_config_batch_identity_is_derived_from_any_two(micro, accum, dp):
    tbs = micro * accum * dp
    for given_keys in ({"train_batch_size": tbs, "train_micro_batch_size_per_gpu": micro},
                       {"train_batch_size": tbs, "gradient_accumulation_steps": accum,
                        "train_micro_batch_size_per_gpu": micro},
                       {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum},
                       {"train_batch_size": tbs, "gradient_accumulation_steps": accum}):
        layout = EngineConfig.load(given_keys).batch(dp)
        assert (layout.train_batch_size, layout.micro_batch_size, layout.gradient_accumulation_steps,
                layout.dp) == (tbs, micro, accum, dp)


def test_config_inconsistent_batch_names_every_number():
    cfg = EngineConfig.load({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
                             "gradient_accumulation_steps": 2})
    with pytest.raises(ConfigError, match=r"4 x 2 x 3 = 24, not 30"):
        cfg.batch(3)
    with pytest.raises(ConfigError, match="not a multiple of micro batch x dp"):
        EngineConfig.load({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}).batch(1)


def test_config_loads_json_and_yaml_files(tmp_path):
    raw = {"train_batch_size": 16, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
    (tmp_path / "c.json").write_text(json.dumps(raw))
    (tmp_path / "c.yaml").write_text("train_batch_size: 16\noptimizer:\n  type: SGD\n  params: {lr: 0.1, momentum: 0.9}\n")
    assert EngineConfig.load(tmp_path / "c.json") == EngineConfig.load(str(tmp_path / "c.yaml"))
    with pytest.raises(ConfigError, match="does not exist"):
        EngineConfig.load(tmp_path / "missing.json")
    (tmp_path / "c.toml").write_text("")
    with pytest.raises(ConfigError, match="use a .json, .yaml or .yml file"):
        EngineConfig.load(tmp_path / "c.toml")


def test_config_pipeline_settings_without_a_pipeline_are_refused_by_name():
    """They would silently do nothing (the pipeline itself: tests/engine/test_engine_pipeline.py)."""
    check_supported(EngineConfig.load({"train_batch_size": 8, "parallel": {"pipeline": 2}}))
    cfg = EngineConfig.load({"train_batch_size": 8, "parallel": {"pipeline_schedule": "zb_h1", "virtual_stages": 2}})
    with pytest.raises(ConfigError) as err:
        check_supported(cfg)
    for field in ("parallel.pipeline_schedule='zb_h1' needs parallel.pipeline > 1",
                  "parallel.virtual_stages=2 needs parallel.pipeline > 1"):
        assert field in str(err.value)
