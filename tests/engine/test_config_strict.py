"""Strict config types and file errors: a string or a boolean where a number belongs, a
malformed file, a directory: each is a `ConfigError` naming the field or the file (issue 19)."""

from __future__ import annotations

import pytest

from tinyscale import ConfigError, EngineConfig

BASE = {"train_batch_size": 8}


@pytest.mark.parametrize("bad, field", [
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage"),
    ({"train_batch_size": "8"}, "train_batch_size"),
    ({"optimizer": {"params": {"lr": "1e-3"}}}, "optimizer.params.lr"),
    ({"optimizer": {"params": {"betas": ["0.9", 0.95]}}}, "optimizer.params.betas.0"),
    ({"gradient_clipping": True}, "gradient_clipping"),
    ({"fp16": {"enabled": 1}}, "fp16.enabled"),
    ({"fp16": {"enabled": "true"}}, "fp16.enabled"),
    ({"zero_optimization": {"overlap_comm": "false"}}, "zero_optimization.overlap_comm"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "10"}}}, "scheduler.params.warmup_num_steps"),
])
def test_config_strict_types_refuse_strings_and_booleans_for_numbers(bad, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        EngineConfig.load({**BASE, **bad})


def test_config_strict_keeps_json_int_for_float_and_integral_float_for_int():
    cfg = EngineConfig.load({"train_batch_size": 8.0, "optimizer": {"params": {"lr": 1, "weight_decay": 0}},
                             "zero_optimization": {"reduce_bucket_size": 5e8}})
    assert cfg.train_batch_size == 8 and isinstance(cfg.train_batch_size, int)
    assert cfg.optimizer.params.lr == 1.0 and isinstance(cfg.optimizer.params.lr, float)
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    with pytest.raises(ConfigError, match="'train_batch_size'"):
        EngineConfig.load({"train_batch_size": 8.5})


def test_config_strict_malformed_json_names_file_line_and_column(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,}\n}')
    with pytest.raises(ConfigError, match=rf"{path}, line 3, column 28: invalid JSON"):
        EngineConfig.load(path)


def test_config_strict_malformed_yaml_names_file_line_and_column(tmp_path):
    path = tmp_path / "ds.yaml"
    path.write_text("train_batch_size: 8\nfp16: {enabled: true\nbf16: 1\n")
    with pytest.raises(ConfigError, match=rf"{path}, line 3, column 5: invalid YAML"):
        EngineConfig.load(str(path))


def test_config_strict_directory_and_non_mapping_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match=rf"{tmp_path} is a directory"):
        EngineConfig.load(tmp_path)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=rf"{listed} holds a list, not a mapping"):
        EngineConfig.load(listed)
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match=rf"{binary} cannot be read"):
        EngineConfig.load(binary)
