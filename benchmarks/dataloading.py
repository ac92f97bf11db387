"""Feeding the ranks: DataLoader workers and prefetch against a loader-bound training loop.

Answers OPT-14 (lesson 02, "Feeding the ranks"). Each sample costs `--io-ms` of waiting
(a stand-in for reading and decoding from disk or network: it takes no CPU, as real I/O
mostly does not) plus slicing bytes of the standard library's sources; the "step" costs
`--step-ms` of waiting too. For each loader setting it reports samples/s and the fraction
of the loop spent waiting for data: the loader is the bottleneck while that fraction is
well above 0. Waits, not computation, so the result means the same on a busy 2-core
machine; CPU-heavy decoding would also need free cores for the workers.

    .venv/bin/python benchmarks/dataloading.py [--io-ms 2] [--step-ms 20] [--batches 20]

Tests: `pytest -k dataloading`.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, Dataset

from tinyscale.data import stdlib_corpus
from tinyscale.bench import add_json_argument, write_json


class SlowBytes(Dataset):
    """Sample i: 129 bytes of the corpus at a fixed offset, after `io_s` seconds of waiting."""

    def __init__(self, n: int, io_s: float, seq_len: int = 128) -> None:
        self.tokens = stdlib_corpus("train").tokens
        self.n, self.io_s, self.seq_len = n, io_s, seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.io_s)
        start = (i * 7919) % (len(self.tokens) - self.seq_len - 1)
        row = self.tokens[start: start + self.seq_len + 1].long()
        return row[:-1], row[1:]


def measure(loader: DataLoader, step_s: float) -> dict:
    """Run one epoch with a step of `step_s` seconds per batch; time spent waiting for data."""
    waited, start = 0.0, time.perf_counter()
    it = iter(loader)
    samples = 0
    while True:
        t = time.perf_counter()
        try:
            x, _ = next(it)
        except StopIteration:
            break
        waited += time.perf_counter() - t
        samples += x.shape[0]
        time.sleep(step_s)  # the training step
    total = time.perf_counter() - start
    return {"samples_per_s": samples / total, "data_wait_fraction": waited / total, "samples": samples}


SETTINGS = [dict(num_workers=0), dict(num_workers=1, prefetch_factor=2), dict(num_workers=2, prefetch_factor=2),
            dict(num_workers=4, prefetch_factor=2), dict(num_workers=4, prefetch_factor=4)]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--io-ms", type=float, default=2.0)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batches", type=int, default=20)
    add_json_argument(parser)
    args = parser.parse_args(argv)
    data = SlowBytes(args.batch * args.batches, args.io_ms / 1e3)
    print(f"{args.batch} samples per batch, {args.io_ms} ms of I/O per sample "
          f"({args.batch * args.io_ms:.0f} ms per batch in one process), {args.step_ms} ms per step")
    rows = []
    for setting in SETTINGS:
        loader = DataLoader(data, batch_size=args.batch, pin_memory=torch.cuda.is_available(), **setting)
        r = {**setting, **measure(loader, args.step_ms / 1e3)}
        rows.append(r)
        print(f"workers {setting['num_workers']}, prefetch {setting.get('prefetch_factor', '-')}: "
              f"{r['samples_per_s']:7.0f} samples/s, waiting for data {r['data_wait_fraction']:5.1%} of the time")
    write_json(args.json, {}, rows=rows)
    return rows


if __name__ == "__main__":
    main()
