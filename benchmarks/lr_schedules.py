"""Learning-rate schedules, plotted from the engine's own schedule (`tinyscale.optim.lr_at`).

Answers OPT-16 (lesson 02, "Learning-rate schedules"): warm-up, constant, linear and
cosine decay over the same run, and what a larger global batch changes when the token
budget is fixed (fewer optimizer steps; a larger peak under the linear scaling rule of
Goyal et al., 2017, sec. 2.1, which is a rule of thumb, not measured here). The engine
calls the same `lr_at(step, config)` before every optimizer step (engine.py), so the
curves are what a run with these configs uses.

    .venv/bin/python benchmarks/lr_schedules.py [--out runs/02-lr-schedules.svg] [--json PATH]

It writes under runs/ by default, so `make bench` leaves the tracked figure alone; `make
figures` (or `--out lessons/figures/02-lr-schedules.svg`) refreshes the lesson's figure on purpose.

Tests: `pytest -k lr_schedule`.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from tinyscale.bench import add_json_argument, write_json
from tinyscale.config import EngineConfig
from tinyscale.optim import lr_at

PEAK, WARMUP, TOTAL = 3e-3, 10, 100


def config(kind: str, *, peak: float = PEAK, warmup: int = WARMUP, total: int = TOTAL,
           warmup_type: str = "linear") -> EngineConfig:
    """An engine config whose only interesting part is its scheduler."""
    params = {"warmup_min_lr": 0.0, "warmup_max_lr": peak, "warmup_num_steps": warmup, "warmup_type": warmup_type}
    if kind != "WarmupLR":
        params["total_num_steps"] = total
    if kind == "WarmupCosineLR":
        params = {k: v for k, v in params.items() if k not in ("warmup_max_lr", "warmup_min_lr")}
        params["cos_min_ratio"] = 0.1
    return EngineConfig.load({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": peak}},
                              "scheduler": {"type": kind, "params": params}})


def series(cfg: EngineConfig, steps: int) -> list[float]:
    """The learning rate of optimizer steps 0 .. steps-1, as the engine sets it."""
    return [lr_at(step, cfg) for step in range(steps)]


CURVES = {
    "WarmupLR (linear warm-up, then constant)": lambda: config("WarmupLR"),
    "WarmupLR, log warm-up": lambda: config("WarmupLR", warmup_type="log"),
    "WarmupDecayLR (linear decay to 0 at T)": lambda: config("WarmupDecayLR"),
    "WarmupCosineLR (cosine to 0.1 x peak at T)": lambda: config("WarmupCosineLR"),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/02-lr-schedules.svg",
                        help="the figure (make figures: lessons/figures/02-lr-schedules.svg)")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        print("benchmarks/lr_schedules.py needs matplotlib (pip install -e '.[notebooks]'): nothing drawn")
        write_json(args.json, {}, skipped="not installed: matplotlib")
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for label, make in CURVES.items():
        values = series(make(), TOTAL + 10)
        left.plot(range(len(values)), values, label=label)
        print(f"{label:45s} step 0 {values[0]:.2e}  step {WARMUP // 2} {values[WARMUP // 2]:.2e}  "
              f"step {WARMUP} {values[WARMUP]:.2e}  step {TOTAL - 1} {values[TOTAL - 1]:.2e}")
    left.set(xlabel="optimizer step", ylabel="learning rate", title=f"warm-up {WARMUP} steps, T = {TOTAL}")
    left.legend(fontsize=8)
    # The same token budget with a global batch of B and of 2B: half the steps (warm-up and
    # T in steps halve), and under the linear scaling rule twice the peak.
    for factor, style in ((1, "-"), (2, "--")):
        cfg = config("WarmupCosineLR", peak=PEAK * factor, warmup=WARMUP // factor, total=TOTAL // factor)
        values = series(cfg, TOTAL // factor)
        tokens = [step * factor for step in range(len(values))]  # in units of B's tokens per step
        right.plot(tokens, values, style, label=f"global batch {factor}B: {TOTAL // factor} steps, peak {factor}x")
    right.set(xlabel="tokens seen (in steps of batch B)", ylabel="learning rate",
              title="same tokens, batch B vs 2B (linear scaling rule)")
    right.legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, metadata={"Date": None} if args.out.endswith(".svg") else None)
    print(f"wrote {args.out}")
    write_json(args.json, {}, figure=args.out)


if __name__ == "__main__":
    main()
