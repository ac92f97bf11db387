"""The site's memory calculator (docs/assets/calculator.js) computes what Python computes.

`tinyscale.calculator.estimate` composes ZeRO's model-state and communication formulas
(tinyscale.zero.estimate) and the activation formula (tinyscale.checkpointing.formula; under
cp, ring attention's block from tinyscale.planner.estimate.layer_activation_bytes);
the page's JavaScript is a port of it. Here both run on the same grid of inputs in node and
must give the same bytes exactly (the port does the same float operations in the same
order) and refuse the same impossible layouts. The page itself is checked in Chromium by
tests/site/test_site_browser.py. Run: `pytest -k calculator`.
"""

from __future__ import annotations

import json

import pytest
import torch

from tinyscale.calculator import estimate
from tinyscale.checkpointing.formula import block_saved_bytes
from tinyscale.models.config import PRESETS
from tinyscale.zero.estimate import comm_bytes_per_rank, model_state_bytes

from .grid import calculator_grid, run_node


def python_or_error(inputs: dict):
    try:
        return estimate(inputs), None
    except ValueError as err:
        return None, str(err)


def test_calculator_js_equals_python_on_a_grid():
    grid = calculator_grid(400)
    results = run_node(grid)
    valid = 0
    for inputs, (js, js_error) in zip(grid, results, strict=True):
        py, py_error = python_or_error(inputs)
        assert (py_error is None) == (js_error is None), (inputs, py_error, js_error)
        if py is not None:
            valid += 1
            assert js == py, inputs  # exact: same operations, same order
    assert valid >= 100, f"only {valid} valid layouts in the grid: widen it"


def test_calculator_presets_are_the_models_presets():
    grid = [{"model": name, "dp": 1, "zero_stage": 0, "seq_len": 8, "micro_batch": 1} for name in PRESETS]
    for name, (js, _) in zip(PRESETS, run_node(grid), strict=True):
        assert js is not None and js["num_params"] == PRESETS[name].num_params(), name


def test_calculator_without_tp_pp_cp_is_zero_and_checkpointing_formulas():
    """With tp = pp = cp = 1 nothing planned enters: ZeRO's bytes and our block's, as is."""
    cfg = PRESETS["gpt2-124m"]
    out = estimate(dict(model="gpt2-124m", dp=16, zero_stage=2, micro_batch=2, seq_len=512,
                        checkpointing="selective", num_microbatches=4))
    states = model_state_bytes(cfg.num_params(), 16, 2)
    assert out["device"]["parameters"] == states.device.parameters
    assert out["device"]["optimizer_states"] + out["device"]["master_weights"] == 12 * cfg.num_params() / 16
    s, b, h, a = 512, 2, cfg.d_model, cfg.n_head
    kept, full = (block_saved_bytes(cfg, b, s, torch.bfloat16, policy) for policy in ("selective", "none"))
    assert out["device"]["activations"] == cfg.n_layer * kept + (full - kept)
    # bf16: half the float32 bytes, but each RMSNorm's upcast input and 1/rms and sdpa's log-sum-exp
    # stay float32 (tests/memory/test_calculator_measured.py measures a bf16 block's saved tensors)
    float32 = 2 * (2 * s * b * h + 2 * s * b)  # the norms' inputs and 1/rms: 2 more bytes an element
    assert full == block_saved_bytes(cfg, b, s, torch.float32, "none") // 2 + float32 + 2 * a * s * b
    assert kept == block_saved_bytes(cfg, b, s, torch.float32, "selective") // 2 + float32
    assert out["comm"]["dp"] == comm_bytes_per_rank(cfg.num_params(), 2, 16, 2, num_microbatches=4)
    assert out["comm"]["tp"] == out["comm"]["pp"] == out["comm"]["cp"] == 0


def test_calculator_rejects_impossible_layouts_by_name():
    for bad, field in ((dict(tp=5), "tp="), (dict(pp=13), "pp="), (dict(cp=3, seq_len=1024), "cp="),
                       (dict(zero_stage=1, offload="cpu"), "offload="), (dict(dtype="fp8"), "dtype=")):
        with pytest.raises(ValueError, match=field):
            estimate(bad)


def test_calculator_from_a_shell_prints_the_estimate(capsys):
    from tinyscale.calculator import main

    argv = ["--model", "custom", "--n-layer", "3", "--d-model", "96", "--n-head", "6", "--n-kv-head", "2",
            "--attn-impl", "math", "--dropout", "0.1", "--tie-embeddings", "true", "--dp", "4",
            "--zero-stage", "2", "--offload", "cpu", "--checkpointing", "selective", "--num-microbatches", "3"]
    assert main(argv) == 0
    want = estimate(dict(model="custom", n_layer=3, d_model=96, n_head=6, n_kv_head=2, attn_impl="math",
                         dropout=0.1, tie_embeddings=True, dp=4, zero_stage=2, offload="cpu",
                         checkpointing="selective", num_microbatches=3))
    assert json.loads(capsys.readouterr().out) == want
    assert main(["--tp", "5"]) == 2
    assert "tp=5" in capsys.readouterr().err
