"""OPT-14's loader benchmark (benchmarks/dataloading.py): workers and prefetch change the
speed, never the data; and the wait it reports is real waiting. Run: `pytest -k dataloading`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("dataloading", ROOT / "benchmarks/dataloading.py")
dataloading = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dataloading)


def test_dataloading_workers_yield_the_same_batches_in_the_same_order():
    data = dataloading.SlowBytes(24, io_s=0.0)
    plain = [x for x, _ in DataLoader(data, batch_size=4)]
    workers = [x for x, _ in DataLoader(data, batch_size=4, num_workers=2, prefetch_factor=2)]
    assert len(plain) == 6 and all(torch.equal(a, b) for a, b in zip(plain, workers, strict=True))


def test_dataloading_reports_the_loader_as_the_bottleneck_when_it_is():
    # 8 samples x 5 ms of I/O per batch in one process against a 0-second step: almost all waiting
    loader = DataLoader(dataloading.SlowBytes(16, io_s=0.005), batch_size=8)
    r = dataloading.measure(loader, step_s=0.0)
    assert r["samples"] == 16 and r["data_wait_fraction"] > 0.5
