"""MFU and HFU equal their formulas on synthetic timings; the windowed tracker sums over steps
where nanoGPT's running MFU does not; the peak table and the measured peak behave."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from tinyscale.mfu import (
    PEAK_TFLOPS,
    WindowedMFU,
    device_key,
    forward_flops,
    hfu,
    measured_peak,
    mfu,
    model_flops_per_token,
    nanogpt_running_mfu,
    peak_flops,
)
from tinyscale.models import GPT, GPTConfig

# Ratios of floats computed in different orders: a few ulps apart, never more.
REL = 1e-12


@given(batch=st.integers(1, 4), seq_len=st.integers(1, 32), seconds=st.floats(1e-3, 10.0),
       devices=st.integers(1, 8))
def test_mfu_on_a_synthetic_timing_equals_counted_flops_over_time_and_peak(batch, seq_len, seconds, devices):
    cfg = GPTConfig.preset("tiny").with_(attn_impl="math")
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    with FlopCounterMode(display=False) as counter:
        GPT(cfg)(x, x).backward()
    peak = peak_flops("H100 SXM", torch.bfloat16)
    # Every device ran this step on its own batch in `seconds`: the job did devices x the FLOPs.
    expected = devices * counter.get_total_flops() / (seconds * devices * peak)
    tokens_per_s = devices * batch * seq_len / seconds
    assert mfu(tokens_per_s, cfg, peak, seq_len=seq_len, num_devices=devices) == pytest.approx(expected, rel=REL)
    assert hfu(tokens_per_s, cfg, peak, seq_len=seq_len, num_devices=devices) == pytest.approx(expected, rel=REL)


def test_mfu_hfu_counts_recomputation_and_mfu_does_not():
    cfg, T, peak = GPTConfig.preset("small"), 128, 1e12
    f = forward_flops(cfg, T)
    fused = f.backward_rerun  # the preset's SDPA core: its backward recomputes Q K^T
    assert fused == f.scores > 0
    full = hfu(1000.0, cfg, peak, seq_len=T, recompute="full", early_stop=False)  # re-entrant: whole blocks
    assert full == pytest.approx(1000.0 * (f.model + f.qkvo + f.attention + f.mlp + fused) / T / peak, rel=REL)
    stopped = hfu(1000.0, cfg, peak, seq_len=T, recompute="full")  # the default: each block's w_down not rerun
    assert stopped == pytest.approx(1000.0 * (f.model + f.qkvo + f.attention + f.mlp - f.mlp_last + fused) / T / peak,
                                    rel=REL)
    assert full > stopped > mfu(1000.0, cfg, peak, seq_len=T)
    assert mfu(1000.0, cfg, peak) == mfu(1000.0, cfg, peak, seq_len=cfg.max_seq_len)  # the default T


def _scripted_run(stall_every: int, stall_at: int, steps: int = 100) -> list[float]:
    """0.1 s steps, and a 1.0 s one (a data-shard load, an eval) every `stall_every` steps."""
    return [1.0 if i % stall_every == stall_at else 0.1 for i in range(steps)]


@pytest.mark.parametrize("stall_at, nanogpt_over_true", [(5, 1.9), (0, 0.19)])
def test_mfu_windowed_vs_nanogpt_running_average(stall_at, nanogpt_over_true):
    """Logging every 10 steps, nanoGPT samples one step in ten. A stall between logs is never
    seen (MFU over-reported 1.9x); a stall on the logged step (nanoGPT evaluates on logged
    steps) is taken for the steady state (under-reported 0.19x). The window sums every step."""
    tokens, flops, peak = 4096, 6e6, 1e12
    times = _scripted_run(10, stall_at)
    tracker = WindowedMFU(flops, peak, window=10)
    for dt in times:
        tracker.update(tokens, dt)
    true = 10 * tokens * flops / (sum(times[-10:]) * peak)  # the last 10 steps: 9 x 0.1 s + 1 x 1.0 s
    assert tracker.mfu == pytest.approx(true, rel=REL)
    assert tracker.tokens_per_second == pytest.approx(10 * tokens / 1.9, rel=REL)
    logged = nanogpt_running_mfu(times, tokens, flops, peak, log_interval=10)
    assert logged[0] == -1.0  # step 0: before nanoGPT's 5 settling steps
    assert logged[-1] / tracker.mfu == pytest.approx(nanogpt_over_true, rel=1e-9)  # EMA of equal samples


def test_mfu_windowed_skips_warmup_and_forgets_old_steps():
    tracker = WindowedMFU(1.0, 1.0, window=2, warmup_steps=1, hardware_flops_per_token=2.0)
    assert tracker.mfu is None and tracker.hfu is None
    tracker.update(100, 10.0)  # warm-up: ignored
    assert tracker.mfu is None
    for tokens, seconds in [(10, 1.0), (30, 1.0), (50, 3.0)]:
        tracker.update(tokens, seconds)
    assert tracker.tokens_per_second == pytest.approx(80 / 4.0, rel=REL)  # only the last two steps
    assert tracker.hfu == pytest.approx(2 * tracker.mfu, rel=REL)


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200 SXM"), ("NVIDIA A100-SXM4-40GB", "A100"), ("NVIDIA A100 80GB PCIe", "A100"),
    ("NVIDIA L4", "L4"), ("NVIDIA L40S", "L40S"), ("NVIDIA A10", "A10"), ("Tesla T4", "T4"),
    ("Tesla V100-SXM2-16GB", "V100 SXM2"), ("AMD Instinct MI300X", "MI300X"), ("Intel Xeon", None),
])
def test_mfu_peak_table_finds_devices_by_torch_name(name, key):
    assert device_key(name) == key


def test_mfu_peak_table_is_dense_and_consistent():
    for device, row in PEAK_TFLOPS.items():
        if "bfloat16" in row and "float8" in row:
            assert row["float8"] == pytest.approx(2 * row["bfloat16"], rel=0.01), device  # fp8 = 2x bf16 (dense)
        if "tf32" in row:
            assert row["bfloat16"] == pytest.approx(2 * row["tf32"], rel=0.01), device  # bf16 = 2x tf32
    assert peak_flops("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312e12  # not the sparse 624
    assert peak_flops("H100 SXM", "tf32") == 494.5e12


def test_mfu_measured_peak_on_cpu_is_positive_and_fast():
    import time

    start = time.perf_counter()
    peak = measured_peak("cpu", torch.float32, max_seconds=0.3)
    assert time.perf_counter() - start < 2.0
    assert math.isfinite(peak) and 1e8 < peak < 1e14  # between 0.1 GFLOP/s and 100 TFLOP/s


def test_mfu_bad_inputs_raise_value_errors_that_name_the_field():
    cfg = GPTConfig.preset("tiny")
    cases = [
        (lambda: mfu(-1.0, cfg, 1e12), "tokens_per_second"),
        (lambda: mfu(float("nan"), cfg, 1e12), "tokens_per_second"),
        (lambda: mfu(1.0, cfg, 0.0), "peak_flops"),
        (lambda: mfu(1.0, cfg, 1e12, num_devices=0), "num_devices"),
        (lambda: mfu(1.0, cfg, 1e12, seq_len=0), "seq_len"),
        (lambda: peak_flops("Voodoo 3", torch.bfloat16), "not in the peak table"),
        (lambda: peak_flops("V100 SXM2", torch.bfloat16), "no bfloat16 peak"),
        (lambda: peak_flops("H100 SXM", "int4"), "dtype"),
        (lambda: peak_flops(torch.device("cpu"), torch.float32), "measured_peak"),
        (lambda: WindowedMFU(1.0, 1.0, window=0), "window"),
        (lambda: WindowedMFU(1.0, 1.0).update(10, 0.0), "seconds"),
        (lambda: WindowedMFU(1.0, 1.0).update(-1, 1.0), "tokens"),
        (lambda: measured_peak("cpu", max_seconds=0), "max_seconds"),
    ]
    for call, field in cases:
        with pytest.raises(ValueError, match=field):
            call()
    assert model_flops_per_token(cfg, 8) > 0
