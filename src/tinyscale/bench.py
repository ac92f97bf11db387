"""The timing harness every benchmark shares, and the `--json` file each writes.

    from tinyscale.bench import add_json_argument, round_robin, summary, write_json

- `round_robin(variants, steps, warmup=...)`: one step of each variant in turn, `warmup` +
  `steps` rounds, so a change in the machine's load (other processes on the shared cores)
  hits every variant alike; the warm-up rounds are dropped. `before` runs ahead of each timed
  step, untimed (a `dist.barrier()`, so the ranks start each step together).
- `slowest(per_rank)`: step by step, the slowest rank's time (a step ends when all do).
- `summary(times)`: median, fastest and slowest step: the median is the figure, min .. max
  its spread.
- `write_json(path, ratios)`: the benchmark's ratios under the keys `make bench` merges into
  runs/bench.json, with the machine and its load when measured (`uptime`'s load averages:
  timings on a shared machine mean little without it).

    python -m tinyscale.bench merge OUT.json IN.json ...   (what `make bench` runs)
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


def round_robin(variants: Mapping[str, Callable[[int], object]], steps: int, *, warmup: int = 1,
                before: Callable[[], object] | None = None) -> dict[str, list[float]]:
    """{name: [seconds of each timed step]}: `warmup` + `steps` rounds, each variant once a
    round, called with the round's index (0 .. warmup + steps - 1: which batch to take)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(warmup + steps):
        for name, step in variants.items():
            if before is not None:
                before()
            start = time.perf_counter()
            step(i)
            times[name].append(time.perf_counter() - start)
    return {name: t[warmup:] for name, t in times.items()}


def slowest(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Step i's time over ranks: the slowest rank's (the step is done when every rank is)."""
    return [max(step) for step in zip(*per_rank)]


@dataclass(frozen=True)
class Summary:
    median: float
    low: float
    high: float
    n: int

    def ms(self) -> str:
        return f"{self.median * 1e3:.1f} ({self.low * 1e3:.0f} .. {self.high * 1e3:.0f})"


def summary(times: Sequence[float]) -> Summary:
    return Summary(statistics.median(times), min(times), max(times), len(times))


def machine() -> dict:
    return {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "platform": platform.platform(), "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def add_json_argument(parser) -> None:
    parser.add_argument("--json", metavar="PATH", help="also write this run's ratios (and the machine's load) "
                                                      "to PATH as JSON (make bench merges them)")


def write_json(path: str | None, ratios: Mapping[str, float], **details) -> None:
    """Write {"ratios": ..., "machine": ..., **details} to `path` (nothing when path is None)."""
    if path is None:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    record = {"ratios": {k: round(float(v), 4) for k, v in ratios.items()}, "machine": machine(), **details}
    Path(path).write_text(json.dumps(record, indent=2, default=str) + "\n")


def merge(out: str, inputs: Sequence[str]) -> dict:
    """One file of every benchmark's ratios: {"ratios": {key: value}, "runs": {file: record}}."""
    ratios, runs = {}, {}
    for name in inputs:
        record = json.loads(Path(name).read_text())
        ratios.update(record.get("ratios", {}))
        runs[Path(name).stem] = record
    merged = {"ratios": ratios, "runs": runs}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(merged, indent=2) + "\n")
    return merged


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "merge":
        sys.exit("usage: python -m tinyscale.bench merge OUT.json IN.json ...")
    print(json.dumps(merge(sys.argv[2], sys.argv[3:])["ratios"], indent=2))
