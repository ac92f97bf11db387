"""ZeRO's estimator: the paper's Table 1 and communication volumes, the formulas' properties,
offload's bookkeeping, and `tinyscale estimate`. Pure arithmetic: no processes."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tinyscale.cli import main
from tinyscale.zero.estimate import (
    CATEGORIES,
    LOCATIONS,
    STAGES,
    TABLE1_DPS,
    comm_bytes_per_rank,
    comm_volume,
    formula,
    max_params_that_fit,
    model_state_bytes,
    round_like_paper,
    table1,
)

# Rajbhandari et al. 2020, Table 1, the 7.5B-parameter column (GB), at DP 1, 4, 16, 64, 256, 1024.
PAPER_TABLE1 = {
    1: (120, 52.5, 35.6, 31.4, 30.4, 30.1),
    2: (120, 41.3, 21.6, 16.6, 15.4, 15.1),
    3: (120, 30, 7.5, 1.88, 0.47, 0.12),
}

params = st.one_of(st.integers(0, 10**13), st.floats(0, 1e13, allow_nan=False))
dps = st.integers(1, 1 << 20)
stages = st.sampled_from(STAGES)


def device(num_params, dp, stage, **kw):
    return model_state_bytes(num_params, dp, stage, **kw).device.total


def test_zero_estimate_reproduces_table1_of_the_paper():
    ours = table1(7.5e9, TABLE1_DPS)
    for stage, row in PAPER_TABLE1.items():
        assert ours[stage] == row, f"stage {stage}: ours {ours[stage]} vs the paper's {row}"
    assert ours[0] == (120,) * 6  # the baseline, 16 Psi, at every dp


def test_zero_estimate_table1_unrounded_values_and_the_rounding_rule():
    # The paper rounds half up (41.25 -> 41.3), where Python's round() would give 41.2.
    assert device(7.5e9, 4, 2) == 41.25e9 and round(41.25, 1) == 41.2
    assert device(7.5e9, 64, 3) == 1.875e9 and device(7.5e9, 16, 1) == 35.625e9
    assert [round_like_paper(x) for x in (41.25, 35.625, 1.875, 0.46875, 0.1171875)] == \
        [41.3, 35.6, 1.88, 0.47, 0.12]


def test_zero_estimate_formulas_are_the_papers():
    assert [formula(s) for s in STAGES] == ["2Ψ + 2Ψ + 12Ψ", "2Ψ + 2Ψ + 12Ψ/N",
                                           "2Ψ + (2 + 12)Ψ/N", "(2 + 2 + 12)Ψ/N"]
    psi, n = 1e9, 8
    assert device(psi, n, 0) == pytest.approx(16 * psi)
    assert device(psi, n, 1) == pytest.approx(4 * psi + 12 * psi / n)
    assert device(psi, n, 2) == pytest.approx(2 * psi + 14 * psi / n)
    assert device(psi, n, 3) == pytest.approx(16 * psi / n)


def test_zero1_estimate_keeps_params_and_grads_whole_and_shards_the_optimizer():
    # The source documents' "2psi + psi/N" is wrong: fp16 params and grads stay whole.
    b = model_state_bytes(1e9, 8, 1)
    assert (b.device.parameters, b.device.gradients) == (2e9, 2e9)
    assert (b.device.master_weights, b.device.optimizer_states) == (4e9 / 8, 8e9 / 8)
    # Pure fp32 Adam as the engine (and DeepSpeed) runs it, in fp32 elements: Psi + Psi + 3 Psi / N
    # (m, v and the fp32 master copy of the shard).
    fp32 = model_state_bytes(1e9, 8, 1, param_bytes=4, grad_bytes=4, optimizer_bytes=12, master_bytes=4)
    assert fp32.device.total / 4 == pytest.approx(1e9 + 1e9 + 3e9 / 8)


def test_zero1_estimate_pure_fp32_counts_the_master_shard_the_engine_keeps():
    """fp32 ZeRO 1: the docstring's pure-fp32 arguments give the master weights and parameters
    the engine holds (`layout_memory.rank_model_state_bytes`, equal to engine.memory_report():
    tests/engine -k layout_memory); with master_bytes=0 they would miss 4 Psi / N."""
    from tinyscale.config import ZeroConfig
    from tinyscale.engine.layout_memory import rank_model_state_bytes
    from tinyscale.engine.plan import LayoutPlan
    from tinyscale.models import GPTConfig

    cfg = GPTConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=4, d_model=16, ffn_hidden=24)
    psi = cfg.num_params()  # 6480: even, so one unit shards over 2 ranks without padding
    for n in (1, 2):
        got = rank_model_state_bytes(cfg, LayoutPlan(n, n, 1, 1, 1, zero=ZeroConfig(stage=1)), dtype_bytes=4)
        fp32 = model_state_bytes(psi, n, 1, param_bytes=4, grad_bytes=4, optimizer_bytes=12, master_bytes=4)
        assert sum(r["master_weights"] for r in got.values()) == n * fp32.device.master_weights == 4 * psi
        assert all(r["parameters"] == fp32.device.parameters == 4 * psi for r in got.values())


@given(params, dps, dps, stages)
def test_zero_estimate_is_non_increasing_in_dp(num_params, dp_a, dp_b, stage):
    small, large = sorted((dp_a, dp_b))
    assert device(num_params, large, stage) <= device(num_params, small, stage)


@given(params, dps)
def test_zero_estimate_each_stage_holds_no_more_than_the_one_before(num_params, dp):
    per_stage = [device(num_params, dp, s) for s in STAGES]
    assert per_stage[3] <= per_stage[2] <= per_stage[1] <= per_stage[0]


@given(params)
def test_zero_estimate_at_dp_1_every_stage_holds_16_psi(num_params):
    for stage in STAGES:
        assert device(num_params, 1, stage) == pytest.approx(16 * num_params, rel=1e-12, abs=0)


@given(st.floats(1, 1e13), dps)
def test_zero_estimate_approaches_4_2_0_psi_as_dp_grows(num_params, dp):
    # The part that does not shrink, and what is left over it: exactly (sharded bytes) / N.
    for stage, limit, sharded in ((1, 4, 12), (2, 2, 14), (3, 0, 16)):
        excess = device(num_params, dp, stage) - limit * num_params
        assert excess == pytest.approx(sharded * num_params / dp, rel=1e-9, abs=1e-6 * num_params)
    assert device(num_params, 1 << 40, 3) / num_params < 1e-10


def test_zero_estimate_comm_volume_is_2_2_2_3_psi():
    assert [comm_volume(7.5e9, s) for s in STAGES] == [15e9, 15e9, 15e9, 22.5e9]


def test_zero_estimate_comm_volume_with_gradient_accumulation():
    # Stage 2 reduce-scatters every micro-batch; stage 3 gathers and reduce-scatters per micro-batch.
    assert [comm_volume(1, s, num_microbatches=4) for s in STAGES] == [2, 2, 5, 12]


@given(params, dps, stages)
def test_zero_estimate_ring_bytes_are_the_volume_times_n_minus_1_over_n(num_params, dp, stage):
    exact = comm_bytes_per_rank(num_params, stage, dp, 2)
    assert exact == pytest.approx(2 * comm_volume(num_params, stage) * (dp - 1) / dp)
    assert exact <= 2 * comm_volume(num_params, stage)
    # Stages 1 and 2 move the same bytes as DDP at every dp; stage 3 moves 1.5x.
    assert comm_bytes_per_rank(num_params, 1, dp) == comm_bytes_per_rank(num_params, 2, dp) == \
        comm_bytes_per_rank(num_params, 0, dp)
    ddp = comm_bytes_per_rank(num_params, 0, dp)
    assert comm_bytes_per_rank(num_params, 3, dp) == pytest.approx(1.5 * ddp)


def test_zero_estimate_ring_bytes_vanish_at_dp_1_and_approach_the_paper_at_large_dp():
    assert all(comm_bytes_per_rank(7.5e9, s, 1) == 0 for s in STAGES)
    assert comm_bytes_per_rank(7.5e9, 0, 4) == 0.75 * 2 * 15e9
    assert comm_bytes_per_rank(7.5e9, 3, 1 << 30) == pytest.approx(2 * 22.5e9)


@given(params, dps, st.sampled_from([2, 3]), st.sampled_from(["cpu", "nvme"]),
       st.sampled_from(["none", "cpu", "nvme"]))
def test_zero_estimate_offload_moves_bytes_without_changing_the_total(num_params, dp, stage, where,
                                                                     param_where):
    param_where = param_where if stage == 3 else "none"
    kept = model_state_bytes(num_params, dp, stage)
    moved = model_state_bytes(num_params, dp, stage, offload=where, offload_params=param_where)
    for category in CATEGORIES:  # each category is only moved, never resized
        assert moved.bytes(category) == pytest.approx(kept.bytes(category), rel=1e-12, abs=0)
    assert moved.total == pytest.approx(kept.total, rel=1e-12, abs=0)
    assert moved.device.total <= kept.device.total
    assert moved.device.master_weights == moved.device.optimizer_states == moved.device.gradients == 0


def test_zero2_estimate_offload_cpu_keeps_only_fp16_params_on_the_device():
    # ZeRO-Offload: 2 Psi on the device; gradient shard, master weights and Adam states on the host.
    b = model_state_bytes(7.5e9, 4, 2, offload="cpu")
    assert b.device.total == b.device.parameters == 15e9
    assert b.host.gradients == 2 * 7.5e9 / 4 and b.host.master_weights == 4 * 7.5e9 / 4
    assert b.host.optimizer_states == 8 * 7.5e9 / 4 and b.disk.total == 0
    assert (formula(2, "device", offload="cpu"), formula(2, "host", offload="cpu")) == ("2Ψ", "(2 + 12)Ψ/N")


def test_zero3_estimate_infinity_style_leaves_no_model_state_on_the_device():
    b = model_state_bytes(1e12, 64, 3, offload="nvme", offload_params="nvme")
    assert b.device.total == 0
    assert b.disk.parameters == 2e12 / 64 and b.disk.master_weights + b.disk.optimizer_states == 12e12 / 64
    assert b.host.total == b.host.gradients == 2e12 / 64  # where the CPU optimizer reads them
    assert max_params_that_fit(80e9, 64, 3, offload="nvme", offload_params="nvme") == math.inf
    assert max_params_that_fit(80e9, 64, 3, offload="nvme", offload_params="nvme", host_bytes=1e9) == 32e9


def test_zero_estimate_max_params_that_fit():
    assert max_params_that_fit(80e9, 1, 0) == 5_000_000_000  # DDP: 16 bytes per parameter
    assert max_params_that_fit(32e9, 1024, 3) == 2_048_000_000_000  # 16/1024 bytes per parameter
    assert max_params_that_fit(32e9, 1, 2, offload="cpu") == 16_000_000_000  # 2 bytes on the device


@given(st.floats(1e6, 1e12), dps, stages)
def test_zero_estimate_max_params_is_the_largest_that_fits(device_bytes, dp, stage):
    n = max_params_that_fit(device_bytes, dp, stage)
    assert device(n, dp, stage) <= device_bytes * (1 + 1e-12)
    assert device(n + 1, dp, stage) > device_bytes * (1 - 1e-12)


def test_zero_estimate_breakdown_bytes_sums_like_memory_report():
    b = model_state_bytes(1e9, 4, 2, offload="cpu")
    assert b.bytes() == b.total and b.bytes(location="device") == b.device.total
    assert b.bytes("gradients") == b.host.gradients == 0.5e9
    assert sum(b.bytes(location=loc) for loc in LOCATIONS) == b.total
    with pytest.raises(ValueError, match="unknown 'activations'"):
        b.bytes("activations")


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_params=-1, dp=4, stage=1), "num_params"),
    (dict(num_params=float("nan"), dp=4, stage=1), "num_params"),
    (dict(num_params=1e9, dp=0, stage=1), "dp=0"),
    (dict(num_params=1e9, dp=4, stage=4), "stage=4"),
    (dict(num_params=1e9, dp=4, stage=1, offload="cpu"), "needs stage 2 or 3"),
    (dict(num_params=1e9, dp=4, stage=2, offload_params="cpu"), "needs stage 3"),
    (dict(num_params=1e9, dp=4, stage=2, offload="disk"), "offload='disk'"),
    (dict(num_params=1e9, dp=4, stage=2, master_bytes=16), "master_bytes"),
])
def test_zero_estimate_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        model_state_bytes(**kwargs)


def test_zero_estimate_cli_prints_table1_and_the_comm_table(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    assert main(["estimate", "--params", "7.5e9"]) == 0
    out = capsys.readouterr().out
    for row in ("52.5 │ 35.6 │ 31.4 │  30.4 │   30.1", "41.3 │ 21.6 │ 16.6 │  15.4 │   15.1",
                "30 │  7.5 │ 1.88 │  0.47 │   0.12", "2Ψ + (2 + 12)Ψ/N", "7,500,000,000"):
        assert row in out, out
    assert "3Ψ" in out and "reduce-scatter" in out and "22.5" in out  # 2 x 15 GB x 3/4 at N=4


def test_zero3_estimate_cli_one_stage_with_offload_and_a_preset(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    assert main(["estimate", "--preset", "llama-1b", "--zero", "3", "--dp", "8",
                 "--offload", "cpu", "--offload-params", "nvme"]) == 0
    out = capsys.readouterr().out
    assert "1,235,814,400" in out and "3 P_os+g+p" in out and "2 P_os+g" not in out
    assert "disk" in out and "host" in out


@pytest.mark.parametrize("argv, message", [
    (["--params", "-1"], "--params"),
    (["--dp", "4", "0"], "--dp 0"),
    (["--zero", "4"], "--zero 4"),
    (["--zero", "1", "--offload", "cpu"], "--offload needs --zero 2 or 3"),
])
def test_zero_estimate_cli_bad_input_exits_2_with_the_fix(argv, message, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["estimate", *argv]) == 2
    assert message in capsys.readouterr().out


def test_zero_estimate_cli_rejects_unknown_choices_with_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--offload", "disk"])
    assert exit_info.value.code == 2 and "--offload" in capsys.readouterr().err
