"""The engine's monitors (`tinyscale.engine.monitor`): ``pytest -k training_monitor`` and ``-k straggler``.

TensorBoard event files and DeepSpeed-style CSV files are read back and hold what the engine
reported (loss, lr, grad norm, tokens/s, memory, health counts); with wall_clock_breakdown every
rank's times reach rank 0; a loss spike, an fp16 overflow and a non-finite loss are counted; a
rank made slow is named as the straggler, and an even run names none.
"""

from __future__ import annotations

import csv
import logging
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
import tinyscale.deepspeed as deepspeed
from tinyscale.data import local_micro_batches, synthetic_regression_batches, synthetic_token_batches
from tinyscale.models import GPT, GPTConfig, TinyMLP
from tinyscale.testing import run_on_ranks


def _config(out: str, **extra) -> dict:
    monitor = {"enabled": True, "output_path": out, "job_name": "run"}
    return {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "tensorboard": monitor, "csv_monitor": monitor,
            "wall_clock_breakdown": True, **extra}


def _loop_with_monitors(out: str):
    """2 ranks, the DeepSpeed loop at ZeRO 2, 3 steps: the engine's own records, for comparison."""
    ds, *_ = deepspeed.initialize(model=TinyMLP(seed=0), config=_config(out, zero_optimization={"stage": 2}))
    records = []
    for batch in synthetic_regression_batches(num_batches=3, batch_size=8, dim=8, seed=0):
        for chunk in local_micro_batches(batch, dp_rank=ds.engine.dp_rank, dp_size=2, micro_batch_size=2):
            ds.backward(ds(*chunk))
            ds.step()
        records.append((ds.engine.last_step["loss"], ds.get_lr()[0], ds.engine.zero.sharded.last_grad_norm))
    return records, ds.monitor.straggler_report(), ds.monitor.health


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_training_monitor_tensorboard_and_csv_files_hold_the_engines_records(tmp_path):
    pytest.importorskip("tensorboard")
    results = run_on_ranks(_loop_with_monitors, 2, str(tmp_path))
    records, report, health = results[0]
    folder = tmp_path / "run"
    scalars = _scalars(folder)
    steps = [8, 16, 24]  # DeepSpeed's x axis: samples seen
    # event files keep float32: the engine's values rounded to float32, exactly
    for tag, i in (("Train/Samples/train_loss", 0), ("Train/Samples/lr", 1), ("Train/Samples/grad_norm", 2)):
        assert scalars[tag] == [(s, float(torch.tensor(r[i], dtype=torch.float32))) for s, r in zip(steps, records)]
    for tag in ("Train/Samples/tokens_per_s", "Train/Samples/memory_model_states_bytes",
                "Train/Samples/memory_high_water_bytes", "Health/nonfinite_losses", "Health/loss_spikes"):
        assert [s for s, _ in scalars[tag]] == steps, tag
    assert all(v > 0 for _, v in scalars["Train/Samples/memory_model_states_bytes"])
    for r in (0, 1):  # wall_clock_breakdown: every rank's phases, gathered to rank 0
        for phase in ("step", "forward", "backward", "optimizer", "busy"):
            assert len(scalars[f"Time/rank{r}/{phase}_ms"]) == 3
    # DeepSpeed's csv_monitor layout: one file per metric, header (step, last part of the name)
    with (folder / "Train_Samples_train_loss.csv").open() as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "train_loss"]
    assert [(int(s), float(v)) for s, v in rows[1:]] == [(s, r[0]) for s, r in zip(steps, records)]  # exact
    assert len(report["ranks"]) == 2 and health["nonfinite_losses"] == 0
    assert results[1][1] == {"ranks": [], "stragglers": []}  # the report lives on rank 0


def test_training_monitor_health_counts_spikes_overflows_and_nonfinite_losses(caplog):
    config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
              "fp16": {"enabled": True, "initial_scale_power": 4}, "monitor": {"loss_spike_window": 3}}
    cfg = GPTConfig(vocab_size=61, max_seq_len=8, n_layer=1, n_head=2, d_model=8, ffn_hidden=16)
    engine = ts.initialize(GPT(cfg, seed=0, dtype=torch.float32), config)
    batches = synthetic_token_batches(num_batches=6, batch_size=2, seq_len=8, vocab_size=61, seed=0)
    factors = [1.0, 1.0, 1.0, 1.0, 30.0, float("inf")]  # step 4: a spike; step 5: an infinite loss
    with caplog.at_level(logging.WARNING, logger="tinyscale.monitor"):
        for b, factor in zip(batches, factors):
            hook = engine.model.register_forward_hook(lambda m, args, loss, f=factor: loss * f)
            engine.train_batch(b)
            hook.remove()
    health = engine.monitor.health
    assert health["loss_spikes"] == 1 and "loss spike at step 4" in caplog.text
    assert health["nonfinite_losses"] == 1 and health["skipped_steps"] == 1  # fp16: the scaler skipped it
    assert health["memory_high_water_bytes"] > 0


SLEEP_S = 0.2  # far above a step of this model (milliseconds), even on a loaded machine


class SlowOnRank1(TinyMLP):
    """TinyMLP whose forward sleeps on rank 1: a straggler made on purpose."""

    def forward(self, x, y):
        if dist.get_rank() == 1:
            time.sleep(SLEEP_S)
        return super().forward(x, y)


def _straggler_run(slow: bool):
    model = SlowOnRank1(seed=0) if slow else TinyMLP(seed=0)
    config = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "wall_clock_breakdown": True, "monitor": {"straggler_margin": 0.5}}
    engine = ts.initialize(model, config)
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("tinyscale.monitor").addHandler(handler)
    try:
        for b in synthetic_regression_batches(num_batches=3, batch_size=4, dim=8, seed=0):
            engine.train_batch(b)
    finally:
        logging.getLogger("tinyscale.monitor").removeHandler(handler)
    return engine.monitor.straggler_report(), records


def test_straggler_report_names_the_slow_rank():
    report, warnings = run_on_ranks(_straggler_run, 2, True)[0]
    assert report["stragglers"] == [(0, 1), (1, 1), (2, 1)]  # (step, rank): rank 1, every step
    assert all("rank 1" in w for w in warnings) and len(warnings) == 3
    busy = [r["busy"] for r in report["ranks"]]
    assert busy[1] > SLEEP_S > busy[0]  # rank 1 sleeps in its forward; rank 0 waits for it in a collective
    steps = [r["step"] for r in report["ranks"]]
    assert steps[0] > SLEEP_S and steps[1] > SLEEP_S  # both ranks' steps take as long: step time cannot tell


@pytest.mark.thorough
def test_straggler_report_names_no_rank_in_an_even_run():
    """Timing noise on a shared machine can exceed any margin for steps of milliseconds: thorough only."""
    report, warnings = run_on_ranks(_straggler_run, 2, False)[0]
    assert report["stragglers"] == [] and warnings == []
