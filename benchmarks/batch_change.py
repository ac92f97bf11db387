"""Doubling the batch mid-run, with and without re-scaling the learning rate (lesson 12, OPT-16).

The small GPT (`PRESETS["small"]`, float32, one process) trains on the synthetic next-token task
with a global batch of B = 8 rows; after `SWITCH` steps `engine.set_train_batch_size(2B,
lr_scaling=...)` doubles it (engine/batch_change.py: gradient accumulation 1 -> 2) with the lr
kept, times sqrt(2), or times 2. A fourth run keeps B throughout. Every run sees the same rows in
the same order, so at equal samples they have seen the same data; the held-out loss (64 rows
the runs never train on) is plotted against samples seen, for AdamW at two learning rates: 5e-4,
where progress is set by the lr (the regime the scaling rules speak of), and 2e-3, near the
fastest this task takes, where the gradient's noise, not the lr, limits progress.

    .venv/bin/python benchmarks/batch_change.py [--out runs/12-batch-change.png] [--json PATH] [--seeds 3]

It writes under runs/ by default; `--out lessons/figures/12-batch-change.png` refreshes the
lesson's figure on purpose. Tests of the mechanism: `pytest -k batch_change`.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import torch

import tinyscale as ts
from tinyscale.bench import add_json_argument, write_json
from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT
from tinyscale.models.config import PRESETS

B, SEQ, SWITCH, SAMPLES, EVAL_EVERY = 8, 32, 40, 1600, 80  # samples: 40 steps of B, then 80 of 2B
OPTIMIZERS = {"AdamW lr 5e-4": {"type": "AdamW", "params": {"lr": 5e-4, "weight_decay": 0.0}},
              "AdamW lr 2e-3": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.0}}}
MIDWAY = 800  # samples: where the curves are furthest apart
ARMS = {"B throughout": None, "2B, lr kept": "keep", "2B, lr x sqrt(2)": "sqrt", "2B, lr x 2": "linear"}


def run(optimizer: dict, arm: str | None, seed: int) -> list[tuple[int, float]]:
    """(samples seen, held-out loss) every EVAL_EVERY samples."""
    rows = synthetic_token_batches(num_batches=1, batch_size=SAMPLES + 64, seq_len=SEQ, vocab_size=256,
                                   seed=seed, noise=0.3)[0]
    held_out = tuple(t[SAMPLES:] for t in rows)
    engine = ts.initialize(GPT(PRESETS["small"], seed=seed), {
        "train_batch_size": B, "train_micro_batch_size_per_gpu": B, "optimizer": optimizer, "steps_per_print": 10**6})
    curve, seen = [], 0
    while seen < SAMPLES:
        if seen % EVAL_EVERY == 0:
            engine.model.eval()
            with torch.no_grad():
                curve.append((seen, float(engine.model(*held_out))))
            engine.model.train()
        if engine.step == SWITCH and arm is not None:
            engine.set_train_batch_size(2 * B, lr_scaling=None if arm == "keep" else arm)
        n = engine.batch.train_batch_size
        engine.train_batch(tuple(t[seen:seen + n] for t in rows))
        seen += n
    engine.model.eval()
    with torch.no_grad():
        curve.append((seen, float(engine.model(*held_out))))
    return curve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/12-batch-change.png", help="the figure (lesson 12's: "
                        "lessons/figures/12-batch-change.png)")
    parser.add_argument("--seeds", type=int, default=3, help="runs per curve, averaged")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    curves = {}
    for name, optimizer in OPTIMIZERS.items():
        for label, arm in ARMS.items():
            per_seed = [run(optimizer, ARMS[label], seed) for seed in range(args.seeds)]
            mean = [(s, sum(c[i][1] for c in per_seed) / len(per_seed)) for i, (s, _) in enumerate(per_seed[0])]
            curves[f"{name}: {label}"] = mean
            at = dict(mean)
            print(f"{name:14s} {label:18s} held-out loss at the switch ({SWITCH * B} samples) {at[SWITCH * B]:.4f}, "
                  f"at {MIDWAY} {at[MIDWAY]:.4f}, at {SAMPLES} {at[SAMPLES]:.4f}")
    print(f"{time.perf_counter() - start:.0f} s")
    write_json(args.json, {k: dict(v)[MIDWAY] for k, v in curves.items()}, figure=args.out, samples=MIDWAY)
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed (pip install -e '.[notebooks]'): nothing drawn")
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, name in zip(axes, OPTIMIZERS):
        for label in ARMS:
            xs, ys = zip(*curves[f"{name}: {label}"])
            ax.plot(xs, ys, "-" if label == "B throughout" else "--", label=label)
        ax.axvline(SWITCH * B, color="grey", lw=0.8)
        ax.set(xlabel="samples seen", ylabel="held-out loss (mean of %d seeds)" % args.seeds,
               title=f"{name}: batch {B} -> {2 * B} at step {SWITCH}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
