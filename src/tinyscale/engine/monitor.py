"""Watching a run: the config's monitors, per-rank step times, stragglers and health signals.

    config = {..., "tensorboard": {"enabled": True, "output_path": "runs", "job_name": "gpt"},
              "csv_monitor": {"enabled": True, "output_path": "runs", "job_name": "gpt"},
              "wall_clock_breakdown": True}                  # per-rank times, the straggler report
    engine = ts.initialize(model, config); engine.train_batch(batch)
    engine.monitor.health            # {"nonfinite_losses", "nonfinite_grad_norms", "skipped_steps", "loss_spikes", ...}
    engine.monitor.straggler_report()   # each rank's mean busy seconds per step, and the stragglers seen

After every optimizer step (`Engine.train_batch`, or a script's `engine.step()` through
`tinyscale.deepspeed`) rank 0 writes, with DeepSpeed's names where DeepSpeed has one and its
x axis (samples seen): ``Train/Samples/train_loss``, ``lr``, ``loss_scale`` (fp16),
``grad_norm`` (the clipping norm: logged when ``gradient_clipping`` > 0, the only time the
engine computes it, at no extra collective), ``tokens_per_s``, ``mfu`` (when known:
`engine/throughput.py`), ``memory_model_states_bytes`` (the step's peak of parameters,
gradients and optimizer states, counted from the tensors) and ``memory_high_water_bytes`` (the
device's peak allocation on a GPU; the process's peak resident set on a CPU), and the health
counts ``Health/*``. TensorBoard through `torch.utils.tensorboard` (the ``tensorboard``
package: ``pip install tinyscale[monitor]``), CSV as DeepSpeed's csv_monitor writes it (one
file per metric, rows ``step,value``).

With ``wall_clock_breakdown`` every rank's forward, backward and optimizer seconds are
gathered to rank 0 (one all-gather of 5 numbers per step) and logged per rank
(``Time/rank{r}/...``). A rank's *busy* time is its step minus the time it sat blocked in
collectives: a slow rank's peers wait for it inside collectives, so their step times equal
its own, but their busy times do not. A rank whose busy time exceeds the median rank's by
``monitor.straggler_margin`` is named in a warning (OPT-18).

Health (DS-40): non-finite losses (fp16 overflow steps, or divergence, which the engine then
refuses), non-finite gradient norms, steps skipped by the loss scaler, and loss spikes: a loss
above the mean of the last ``monitor.loss_spike_window`` losses by ``loss_spike_factor``
standard deviations (a warning names the step). Tests: ``pytest -k training_monitor``,
``pytest -k straggler``. Lesson 12, "Watching a run".
"""

from __future__ import annotations

import csv
import logging
import math
import resource
import statistics
import sys
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from tinyscale.dist import comm
from tinyscale.precision import MixedPrecisionOptimizer

_PHASES = ("step", "forward", "backward", "optimizer", "busy")
log = logging.getLogger("tinyscale.monitor")


def grad_norm_of(engine) -> float | None:
    """The last step's clipping norm (the full model's, in every layout), or None without clipping."""
    if engine.config.gradient_clipping <= 0:
        return None
    if engine.zero is not None:
        return engine.zero.sharded.last_grad_norm
    if isinstance(engine.optimizer, MixedPrecisionOptimizer):
        return engine.optimizer.last_grad_norm
    return engine.last_grad_norm


def high_water_bytes(device: torch.device) -> int:
    """The device's peak allocation (GPU), or this process's peak resident set (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


class _CsvWriter:
    """DeepSpeed's csv_monitor layout: output_path/job_name/<name with / as _>.csv, rows step,value."""

    def __init__(self, folder: Path):
        self.folder, self.started = folder, set()

    def add_scalar(self, name: str, value: float, step: int) -> None:
        path = self.folder / (name.replace("/", "_").replace(" ", "_") + ".csv")
        with path.open("a", newline="") as f:
            writer = csv.writer(f)
            if path not in self.started:
                self.started.add(path)
                writer.writerow(["step", name.rsplit("/", 1)[-1]])
            writer.writerow([step, value])

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class Monitor:
    """The engine's monitor: built from the config, fed once per optimizer step on every rank."""

    def __init__(self, config, device: torch.device):
        self.config, self.device = config, device
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.per_rank = config.wall_clock_breakdown
        self.writers: list = []
        if self.rank == 0:
            for section, make in ((config.tensorboard, _tensorboard), (config.csv_monitor, _CsvWriter)):
                if section.enabled:
                    folder = Path(section.output_path or ".") / section.job_name
                    folder.mkdir(parents=True, exist_ok=True)
                    self.writers.append(make(folder))
        h = config.monitor
        self.losses: deque[float] = deque(maxlen=h.loss_spike_window)
        self.health = {"nonfinite_losses": 0, "nonfinite_grad_norms": 0, "skipped_steps": 0, "loss_spikes": 0,
                       "memory_high_water_bytes": 0}
        self.rank_times: list[list[list[float]]] = []  # per step: per rank: _PHASES seconds (rank 0)
        self.stragglers: list[tuple[int, int, float, float]] = []  # (step, rank, busy, median busy)

    def record(self, engine) -> None:
        """After an optimizer step (call on every rank: per-rank times are gathered)."""
        last = engine.last_step
        step, loss = last["step"], last["loss"]
        times = self._gather_times(last.get("profile"))  # a collective: before any rank-0-only work
        self._check_health(step, loss, grad_norm_of(engine), engine)
        if times is not None and self.rank == 0:
            self.rank_times.append(times)
            self._check_stragglers(step, [t[_PHASES.index("busy")] for t in times])
        if not self.writers:
            return
        x = engine.samples  # DeepSpeed's x axis: samples seen (the batch may have changed)
        lr = engine._torch_optimizer().param_groups[0]["lr"]  # the lr this step used (DeepSpeed's get_lr()[0])
        scalars = {"Train/Samples/train_loss": loss, "Train/Samples/lr": lr,
                   "Train/Samples/grad_norm": grad_norm_of(engine), "Train/Samples/tokens_per_s": last["tokens_per_s"],
                   "Train/Samples/mfu": last.get("mfu")}
        if engine.loss_scaler is not None:
            scalars["Train/Samples/loss_scale"] = engine.loss_scaler.scale
        if engine._before_step_report is not None:
            scalars["Train/Samples/memory_model_states_bytes"] = engine._before_step_report.total
        scalars["Train/Samples/memory_high_water_bytes"] = self.health["memory_high_water_bytes"]
        scalars |= {f"Health/{k}": v for k, v in self.health.items() if k != "memory_high_water_bytes"}
        for r, row in enumerate(times or []):
            scalars |= {f"Time/rank{r}/{name}_ms": 1e3 * s for name, s in zip(_PHASES, row)}
        for writer in self.writers:
            for name, value in scalars.items():
                if value is not None:
                    writer.add_scalar(name, float(value), x)
            writer.flush()

    def _gather_times(self, profile: dict | None) -> list[list[float]] | None:
        if not self.per_rank or profile is None:
            return None
        mine = [profile["step"], profile["forward"], profile["backward"], profile["optimizer"],
                profile["step"] - profile["comm_exposed"]]
        local = torch.tensor(mine, dtype=torch.float64, device=self.device)
        if self.world == 1:
            return [mine]
        out = torch.empty(self.world * len(mine), dtype=torch.float64, device=self.device)
        comm.all_gather(out, local)
        return out.view(self.world, len(mine)).tolist()

    # --8<-- [start:health]
    def _check_health(self, step: int, loss: float, norm: float | None, engine) -> None:
        h = self.health
        h["skipped_steps"] = engine.skipped_steps
        h["memory_high_water_bytes"] = max(h["memory_high_water_bytes"], high_water_bytes(self.device))
        if norm is not None and not math.isfinite(norm):
            h["nonfinite_grad_norms"] += 1
        if not math.isfinite(loss):
            h["nonfinite_losses"] += 1
            return  # kept out of the spike window
        window = self.losses
        if len(window) == window.maxlen and len(window) > 1:
            mean, spread = statistics.fmean(window), statistics.pstdev(window)
            if spread > 0 and loss > mean + self.config.monitor.loss_spike_factor * spread:
                h["loss_spikes"] += 1
                if self.rank == 0:
                    log.warning("loss spike at step %d: %.6g is %.1f standard deviations above the mean %.6g of "
                                "the last %d steps", step, loss, (loss - mean) / spread, mean, len(window))
        window.append(loss)

    def _check_stragglers(self, step: int, busy: list[float]) -> None:
        median = statistics.median(busy)
        margin = self.config.monitor.straggler_margin
        for r, b in enumerate(busy):
            if b > median * (1 + margin):
                self.stragglers.append((step, r, b, median))
                log.warning("straggler at step %d: rank %d was busy %.4g s, %.0f%% above the median rank's %.4g s",
                            step, r, b, 100 * (b / median - 1) if median > 0 else math.inf, median)

    # --8<-- [end:health]

    def straggler_report(self) -> dict:
        """Rank 0: each rank's mean seconds per step by phase, and the (step, rank) stragglers seen."""
        if not self.rank_times:
            return {"ranks": [], "stragglers": []}
        steps = len(self.rank_times)
        ranks = [{name: sum(t[r][i] for t in self.rank_times) / steps for i, name in enumerate(_PHASES)}
                 for r in range(len(self.rank_times[0]))]
        return {"ranks": ranks, "stragglers": [(s, r) for s, r, _, _ in self.stragglers]}

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def _tensorboard(folder: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # torch's writer needs the tensorboard package
        raise ImportError("config field 'tensorboard.enabled' = true needs the tensorboard package: "
                          "pip install 'tinyscale[monitor]' (or tensorboard), or set tensorboard.enabled false") \
            from exc
    return SummaryWriter(log_dir=str(folder))
