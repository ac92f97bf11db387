"""Lesson 12's "Watching a run" figure: a 2-rank run's TensorBoard events, read back and plotted.

    .venv/bin/python benchmarks/watch_run.py [--steps 40] [--out runs/12-watching-a-run.svg] [--json PATH]

(`make figures` writes the lesson's copy, lessons/figures/12-watching-a-run.svg; `make bench`
only runs/.) Needs tensorboard and matplotlib (the `monitor` and `notebooks` extras); without
them it says so and exits 0 having drawn nothing.

A small GPT trains on the stdlib corpus on 2 CPU ranks through tinyscale.deepspeed's loop, with
the config's ``tensorboard`` and ``wall_clock_breakdown`` on. Two faults are injected on
purpose: rank 1 sleeps 50 ms in each forward for steps 15-24 (a straggler), and step 30's loss
is multiplied by 8 before backward (a spike, as a bad batch gives). The figure is drawn only from
the event files the monitor wrote (`EventAccumulator`), as a user would read them: the loss with
the spike the monitor flagged, the clipping norm, and each rank's busy time (its step minus its
time blocked in collectives) against both ranks' step time.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tinyscale.deepspeed as deepspeed
from tinyscale.bench import add_json_argument, write_json
from tinyscale.data import local_micro_batches, sample_batches, stdlib_corpus
from tinyscale.dist import launch
from tinyscale.models import GPT, GPTConfig

SLOW = range(15, 25)  # steps in which rank 1 sleeps in its forward
SPIKE = 30  # the step whose loss is multiplied
SLEEP_S = 0.05


def _train(out: str, steps: int) -> dict:
    corpus = stdlib_corpus()
    cfg = GPTConfig(vocab_size=256, max_seq_len=32, n_layer=2, n_head=4, d_model=32, ffn_hidden=64)
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "wall_clock_breakdown": True,
              "tensorboard": {"enabled": True, "output_path": out, "job_name": "watch"},
              "monitor": {"loss_spike_window": 10, "straggler_margin": 0.5}}
    engine, *_ = deepspeed.initialize(model=GPT(cfg, seed=0), config=config)
    batches = sample_batches(corpus.tokens, num_batches=steps, batch_size=8, seq_len=32, seed=0)

    def slow_down(module, args):  # inside the forward: the time a slow device would take
        if engine.global_steps in SLOW and dist.get_rank() == 1:
            time.sleep(SLEEP_S)
    engine.module.register_forward_pre_hook(slow_down)
    for step, batch in enumerate(batches):
        for chunk in local_micro_batches(batch, dp_rank=engine.engine.dp_rank, dp_size=2, micro_batch_size=2):
            loss = engine(*chunk)
            engine.backward(loss * 8 if step == SPIKE else loss)
            engine.step()
    return {"health": engine.monitor.health, "stragglers": engine.monitor.straggler_report()["stragglers"]}


def plot(folder: Path, out: Path, health: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()

    def series(tag, first=0):
        points = [p for p in events.Scalars(tag) if p.step // 8 - 1 >= first]
        return [p.step // 8 - 1 for p in points], [p.value for p in points]  # samples seen -> step

    fig, (ax_loss, ax_norm, ax_time) = plt.subplots(3, 1, figsize=(7, 7.5), sharex=True)
    steps, loss = series("Train/Samples/train_loss")
    ax_loss.plot(steps, loss, color="C0")
    ax_loss.scatter([SPIKE], [loss[steps.index(SPIKE)]], color="C3", zorder=3,
                    label=f"spike flagged (Health/loss_spikes = {health['loss_spikes']})")
    ax_loss.set_ylabel("train loss")
    ax_loss.legend(loc="upper right", fontsize=8)
    ax_norm.plot(*series("Train/Samples/grad_norm"), color="C2")
    ax_norm.axhline(1.0, color="grey", linestyle=":", linewidth=1, label="gradient_clipping = 1.0")
    ax_norm.set_ylabel("gradient norm")
    ax_norm.legend(loc="upper right", fontsize=8)
    for r, color in ((0, "C0"), (1, "C1")):  # from step 1: step 0 pays for first-call set-up
        ax_time.plot(*series(f"Time/rank{r}/busy_ms", 1), color=color, label=f"rank {r} busy")
        s, t = series(f"Time/rank{r}/step_ms", 1)
        ax_time.plot(s, t, color=color, linestyle="--", linewidth=0.8, label=f"rank {r} step")
    ax_time.axvspan(SLOW.start - 0.5, SLOW.stop - 0.5, color="C1", alpha=0.1, label="rank 1 slowed")
    ax_time.set_yscale("log")  # a slowed rank (x10) and the noise of a shared host (spikes) both visible
    ax_time.set_ylabel("ms per step (log)")
    ax_time.set_xlabel("optimizer step")
    ax_time.legend(loc="upper left", fontsize=8, ncol=3)
    fig.suptitle("Watching a run: TensorBoard events of a 2-rank run, read back", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, format=out.suffix[1:], metadata={"Date": None} if out.suffix == ".svg" else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("runs/12-watching-a-run.svg"),
                        help="the figure (make figures: lessons/figures/12-watching-a-run.svg)")
    parser.add_argument("--png", action="store_true", help="also write a PNG beside the SVG")
    add_json_argument(parser)
    args = parser.parse_args()
    missing = [m for m in ("tensorboard", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"benchmarks/watch_run.py needs {' and '.join(missing)} (pip install -e '.[monitor,notebooks]'): "
              "nothing drawn")
        write_json(args.json, {}, skipped=f"not installed: {', '.join(missing)}")
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        result = launch(_train, 2, tmp, args.steps, timeout_s=600)[0]
        print(result)
        plot(Path(tmp) / "watch", args.out, result["health"])
        if args.png:  # a raster copy to look at
            plot(Path(tmp) / "watch", args.out.with_suffix(".png"), result["health"])
    print(f"wrote {args.out}")
    write_json(args.json, {}, figure=str(args.out))


if __name__ == "__main__":
    main()
