"""Measurements for notebooks/06-mfu.ipynb (lesson 6, "FLOPs, MFU and a step profiler").

Spawned ranks find a function only by importing it, so what runs on ranks lives here, at
module level; the single-process measurements sit beside them to keep the notebook short.

- `cpu_mfu_sweep`: steps/s of the small GPT's training step on this CPU for several batch
  sizes (and with every block recomputed: the `full` policy of `tinyscale.checkpointing`), interleaved with the measured matmul peak, so that
  both see the same interference from other jobs;
- `ddp_profile` (on ranks): BucketedDDP steps under the StepProfiler, with and without
  overlap taking turns step by step, returning the profiler's records.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from tinyscale.checkpointing import apply_policy
from tinyscale.data import synthetic_token_batches
from tinyscale.data_parallel import BucketedDDP
from tinyscale.mfu import StepProfiler, measured_peak
from tinyscale.models import GPT, GPTConfig


def _profiled_step(prof: StepProfiler, model, optimizer, x, y) -> None:
    with prof.step(tokens=x.numel()):
        with prof.phase("forward"):
            loss = model(x, y)
        with prof.phase("backward"):
            loss.backward()
        with prof.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def cpu_mfu_sweep(variants: list[tuple[int, str]], *, preset: str = "small", seq_len: int = 128,
                  rounds: int = 3, steps_per_round: int = 3) -> dict:
    """For each (batch rows, checkpointing policy): profiled float32 steps, interleaved.

    Round-robin: each round measures the peak, then runs `steps_per_round` steps of every
    variant (the first step of each variant ever is a warm-up and dropped). Returns the
    profilers' records per variant and the peak of each round (FLOP/s)."""
    cfg = GPTConfig.preset(preset)
    runs = {}
    for rows, policy in variants:
        torch.manual_seed(0)
        model = apply_policy(GPT(cfg, seed=0), policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = synthetic_token_batches(num_batches=1, batch_size=rows, seq_len=seq_len, seed=0)[0]
        runs[(rows, policy)] = (model, optimizer, x, y, StepProfiler())
        _profiled_step(StepProfiler(), model, optimizer, x, y)  # warm-up, not recorded
    peaks = []
    for _ in range(rounds):
        peaks.append(measured_peak("cpu", torch.float32, max_seconds=0.5))
        for model, optimizer, x, y, prof in runs.values():
            for _ in range(steps_per_round):
                _profiled_step(prof, model, optimizer, x, y)
    return {"peaks": peaks, "records": {k: v[4].records for k, v in runs.items()},
            "threads": torch.get_num_threads()}


def ddp_profile(steps: int = 6, bucket_cap_mb: float = 0.5, rows: int = 4, preset: str = "small") -> dict:
    """On every rank: BucketedDDP training steps of the GPT under the StepProfiler, with overlap
    and without (buckets held until backward ends), taking turns: step i of both, the order
    swapped every other step, a barrier before each, so that the machine's load (2 shared cores,
    other jobs) hits both alike. Run one after the other, they differed by 1.3x either way from
    run to run. Returns both runs' records."""
    cfg = GPTConfig.preset(preset)
    batches = synthetic_token_batches(num_batches=steps, batch_size=rows, seq_len=cfg.max_seq_len,
                                      seed=dist.get_rank())
    runs = {}
    for overlap in (True, False):
        torch.manual_seed(0)
        model = BucketedDDP(GPT(cfg, seed=0), bucket_cap_mb=bucket_cap_mb, overlap=overlap)
        runs["overlap" if overlap else "no_overlap"] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                                        StepProfiler())
    for i, (x, y) in enumerate(batches):
        for key in ("overlap", "no_overlap") if i % 2 == 0 else ("no_overlap", "overlap"):
            model, optimizer, prof = runs[key]
            dist.barrier()
            _profiled_step(prof, model, optimizer, x, y)
    out = {key: prof.records for key, (_, _, prof) in runs.items()}
    out["threads"] = torch.get_num_threads()
    return out


def median(values) -> float:
    return statistics.median(values)


def load_average() -> str:
    """The machine's 1-minute load average, to print next to timings (Linux)."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "unknown"


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M")
