"""The timing harness every benchmark shares, and the `--json` file each writes.

    from tinyscale.bench import add_json_argument, round_robin, summary, write_json

- `round_robin(variants, steps, warmup=...)`: one step of each variant in turn, `warmup` +
  `steps` rounds, so a change in the machine's load (other processes on the shared cores)
  hits every variant alike; the warm-up rounds are dropped. `before` runs ahead of each timed
  step, untimed (a `dist.barrier()`, so the ranks start each step together).
- `slowest(per_rank)`: step by step, the slowest rank's time (a step ends when all do).
- `summary(times)`: median, fastest and slowest step: the median is the figure, min .. max
  its spread.
- `ratio_interval(ours, base)` (and `interval_verdict`): a 95% bootstrap interval for the ratio of two variants'
  medians, over the rounds both were timed in.
- `write_json(path, ratios)`: the benchmark's ratios under the keys `make bench` merges into
  runs/bench.json, with the machine and its load when measured (`uptime`'s load averages:
  timings on a shared machine mean little without it).

    python -m tinyscale.bench merge OUT.json IN.json ...   (what `make bench` runs)
    python -m tinyscale.bench repeat [--runs 3] [--out runs/bench.json]   (make bench-medians)
    python -m tinyscale.bench table runs/bench.json KEY ...   (the Markdown a lesson quotes)

`repeat` runs issue 30's benchmarks (`REPEAT`: each with the sizes given there) `--runs`
times, round robin (run 1 of every benchmark, then run 2 of every one, ...: a change in the
machine's load spreads over all of them instead of landing on one), and writes each ratio's
values and their median to `--out`, with the date, the machine (CPU model, cores, load
averages before and after) and the torch version: what an acceptance figure needs beside it.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


def round_robin(variants: Mapping[str, Callable[[int], object]], steps: int, *, warmup: int = 1,
                before: Callable[[], object] | None = None,
                alternate: tuple[str, str] | None = None, shuffle: int | None = None) -> dict[str, list[float]]:
    """{name: [seconds of each timed step]}: `warmup` + `steps` rounds, each variant once a
    round, called with the round's index (0 .. warmup + steps - 1: which batch to take).

    `alternate`: two variants (the pair a ratio compares) that trade places every other round,
    so each runs right after the same steps as often as the other: what ran just before a step
    changes its time (benchmarks/ddp.py measured about 1 ms of 70 after a step of 39 blocking
    all-reduces, lesson 02).

    `shuffle`: a seed; each round then runs the variants in an order drawn from it and the
    round's index, the same on every rank (they must issue the same collectives), so that with
    many variants each follows every other about equally often (what a pair's `alternate` does
    for two)."""
    if shuffle is not None and alternate is not None:
        raise ValueError("round_robin: give `alternate` (one pair) or `shuffle` (all variants), not both")
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    swapped = order.copy()  # the odd rounds' order
    if alternate is not None:
        a, b = (order.index(name) for name in alternate)
        swapped[a], swapped[b] = order[b], order[a]
    for i in range(warmup + steps):
        if shuffle is not None:
            names = random.Random(shuffle * 1_000_003 + i).sample(order, len(order))
        else:
            names = swapped if i % 2 else order
        for name in names:
            step = variants[name]
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


def ratio_interval(ours: Sequence[float], base: Sequence[float], level: float = 0.95, resamples: int = 2000,
                   seed: int = 0, per_round: bool = False) -> tuple[float, float]:
    """A bootstrap interval for median(ours) / median(base), two variants timed in the same
    rounds (`round_robin`): the rounds resampled with replacement, each round's pair kept
    together; the (1 - level) / 2 and (1 + level) / 2 quantiles of the resampled ratios. An
    interval holding 1.0: the run cannot tell the two apart. `per_round`: the interval of the
    median of each round's ratio ours[i] / base[i] instead (a burst of load that slows a whole
    round divides out; `statistics.median` of those ratios is its figure)."""
    import random

    rng, n = random.Random(seed), len(ours)
    each = [a / b for a, b in zip(ours, base)]
    ratios = []
    for _ in range(resamples):
        rounds = [rng.randrange(n) for _ in range(n)]
        ratios.append(statistics.median([each[i] for i in rounds]) if per_round else
                      statistics.median([ours[i] for i in rounds]) / statistics.median([base[i] for i in rounds]))
    ratios.sort()
    return ratios[int((1 - level) / 2 * resamples)], ratios[min(resamples - 1, int((1 + level) / 2 * resamples))]


def interval_verdict(low: float, high: float, ours: str = "ours") -> str:
    """What an interval of ours / base says: apart only when it does not hold 1.0."""
    return "this run cannot tell them apart" if low <= 1 <= high else f"{ours} faster" if high < 1 else f"{ours} slower"


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


# --8<-- [start:repeat]
# Issue 30's rows: the benchmark, the sizes it runs at here, and the keys it must write. Sized
# so that 3 runs take at most 12 minutes on 2 idle cores: each benchmark's default shapes and
# model (pipeline m 8, 4 layers; CP T 2048, H 8, K 2, D 64, cp 2; DDP 2 and 4 ranks, ZeRO and
# DeepSpeed 2 ranks, small GPT, 4 rows per rank), with fewer timed steps than their defaults
# (after their own warm-up; the step counts are in each run's record). At load 10 to 39 on
# the 2 cores, 3 runs with more steps (pipeline 4, DDP and ZeRO 8, DeepSpeed 6) took 25 minutes
# (2026-11-26), DeepSpeed the largest and most variable part (81 to 310 s a run).
# With these entries 3 idle runs took 666 s (2026-11-27, zero.py at its 50 rounds).
REPEAT: dict[str, tuple[list[str], tuple[str, ...]]] = {
    # pipeline: its default 80 rounds (3 steps could not resolve a 5 % difference; about 45 s idle)
    "pipeline": ([], ("pp_1f1b_vs_torch", "pp_afab_vs_torch", "pp_1f1b_bubble_gap_points")),
    "context_parallel": (["--steps", "3"], ("cp_ring_vs_sdpa", "cp_ulysses_vs_sdpa")),
    # ddp: the ratio's pair alone, 90 rounds. At 30 (with the optional rows) three runs of the 4-rank
    # ratio spread 7 points (0.938, 1.000, 1.008); at 90, 1.6 points, about 40 s a run at 4 ranks
    # (2026-11-27, helper ddp4b). 6 steps could not resolve 2 %.
    "ddp": (["--only", "--steps", "90"], ("ddp_bucketed_vs_torch_2", "ddp_bucketed_vs_torch_4")),
    # zero: only the rows' variants, 120 rounds in about the time 50 rounds of all ten took: at 50,
    # zero1_vs_ddp went 1.021, 0.983, 1.018 and zero2_vs_ddp 0.988, 0.969, 0.985 in three runs.
    "zero": (["--only", "torch DDP,ZeroStage1,ZeroStage2,FSDP2 fully_shard,ZeroStage3", "--steps", "120"],
             ("zero1_vs_ddp", "zero2_vs_ddp", "zero3_vs_fsdp2")),
    # deepspeed: 40 paired steps. At 12, one run's 95% interval on zero0_vs_deepspeed was about
    # +-5 % (0.921-1.087), too wide to place a ratio near 1.0; 40-60 steps narrow it to about
    # +-4 % (2026-11-27, helper lvl0). A step is ~0.1 s a side: about 35 s more a run than 12.
    "deepspeed": (["--steps", "40"], ("zero0_vs_deepspeed", "zero1_vs_deepspeed", "zero2_vs_deepspeed",
                                     "zero3_vs_deepspeed")),
}


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def medians(runs: Sequence[Mapping[str, float]]) -> dict[str, dict]:
    """{key: {"values": [one per run that wrote it], "median": ...}} over every key any run wrote."""
    keys = sorted({k for r in runs for k in r})
    out = {}
    for k in keys:
        values = [r[k] for r in runs if k in r]
        out[k] = {"values": values, "median": round(statistics.median(values), 4)}
    return out


def repeat(runs: int = 3, out: str = "runs/bench.json", benchmarks: Mapping[str, tuple] | None = None,
           folder: str = "benchmarks", python: str = sys.executable, work: str = "runs/bench/repeat") -> dict:
    """Run each benchmark `runs` times, round robin; write and return the record (see module doc)."""
    import torch

    benchmarks = REPEAT if benchmarks is None else benchmarks
    Path(work).mkdir(parents=True, exist_ok=True)
    started, load_before = time.time(), [round(x, 2) for x in os.getloadavg()]
    ratios: dict[str, list[dict]] = {name: [] for name in benchmarks}
    log = []
    for run in range(runs):
        for name, (args, expected) in benchmarks.items():
            path = Path(work) / f"{name}-{run + 1}.json"
            path.unlink(missing_ok=True)
            command = [python, str(Path(folder) / f"{name}.py"), *args, "--json", str(path)]
            print(f"== run {run + 1}/{runs}: {' '.join(command[1:])}", flush=True)
            start = time.time()
            done = subprocess.run(command)
            record = json.loads(path.read_text()) if path.exists() else {}
            got = record.get("ratios", {})
            log.append({"run": run + 1, "benchmark": name, "args": args, "returncode": done.returncode,
                        "seconds": round(time.time() - start, 1), "load_average": record.get("machine", {})
                        .get("load_average"), "missing": [k for k in expected if k not in got],
                        **({"skipped": record["skipped"]} if "skipped" in record else {})})
            ratios[name].append(got)
    result = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
        "machine": {"cpu_model": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
                    "load_average_before": load_before, "load_average_after": [round(x, 2) for x in os.getloadavg()]},
        "torch": torch.__version__, "runs": runs, "seconds": round(time.time() - started, 1),
        "ratios": {k: v["median"] for name in benchmarks for k, v in medians(ratios[name]).items()},
        "medians": {k: v for name in benchmarks for k, v in medians(ratios[name]).items()},
        "log": log,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result
# --8<-- [end:repeat]


def table(record: Mapping, keys: Sequence[str]) -> str:
    """A Markdown table of `repeat`'s record for `keys` (each run's value and the median), with
    the date, machine and torch above it: what a lesson quotes (`... bench table FILE KEY ...`)."""
    m = record["machine"]
    lines = [f"{record['runs']} runs, {record['date_utc']} UTC, {m['cpu_model']} ({m['cores']} cores), load average "
             f"{'/'.join(map(str, m['load_average_before']))} before and "
             f"{'/'.join(map(str, m['load_average_after']))} after, torch {record['torch']}", "",
             "| key | " + " | ".join(f"run {i + 1}" for i in range(record["runs"])) + " | median |",
             "|---|" + "---|" * (record["runs"] + 1)]
    for k in keys:
        v = record["medians"].get(k)
        values = v["values"] if v else []
        cells = [f"{x:.3g}" for x in values] + ["(none)"] * (record["runs"] - len(values))
        lines.append(f"| `{k}` | " + " | ".join(cells) + f" | {'(none)' if v is None else format(v['median'], '.3g')} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "merge":
        print(json.dumps(merge(argv[1], argv[2:])["ratios"], indent=2))
        return 0
    if argv and argv[0] == "repeat":
        import argparse

        parser = argparse.ArgumentParser(prog="python -m tinyscale.bench repeat")
        parser.add_argument("--runs", type=int, default=3)
        parser.add_argument("--out", default="runs/bench.json")
        parser.add_argument("--only", nargs="+", choices=sorted(REPEAT), help="these benchmarks only")
        a = parser.parse_args(argv[1:])
        chosen = {n: REPEAT[n] for n in (a.only or REPEAT)}
        result = repeat(a.runs, a.out, chosen)
        for k, v in result["medians"].items():
            print(f"{k:32s} median {v['median']:8.3f}   runs {v['values']}")
        failed = [e for e in result["log"] if e["returncode"] or (e["missing"] and "skipped" not in e)]
        print(f"{result['seconds']:.0f} s for {a.runs} runs; wrote {a.out}" +
              (f"; {len(failed)} run(s) failed or wrote no ratios: see its log" if failed else ""))
        return 1 if failed else 0
    if len(argv) >= 2 and argv[0] == "table":
        print(table(json.loads(Path(argv[1]).read_text()), argv[2:]))
        return 0
    print("usage: python -m tinyscale.bench merge OUT.json IN.json ...\n"
          "       python -m tinyscale.bench table runs/bench.json KEY ...\n"
          "       python -m tinyscale.bench repeat [--runs 3] [--out runs/bench.json] [--only NAME ...]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
