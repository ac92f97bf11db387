"""tinyscale's engine against DeepSpeed's at ZeRO stages 0-3: same GPT, config and batches, same run.

    python benchmarks/deepspeed.py [--world-size 2] [--model small] [--steps 10] [--micro 4] [--json PATH]

Needs DeepSpeed (the `peers` extra: pip install -e ".[peers]"; `make setup` installs it); without
it, it says so and exits 0 having measured nothing (so `make bench` runs on without the extra;
--json then writes no ratios, and a "skipped" note in place of stale ones). It
runs in a process of its own (`tinyscale.testing.deepspeed_peer`, with DS_ACCELERATOR=cpu and
gloo; DeepSpeed's inference-only shared-memory op skipped, `deepspeed_peer.skip_shm_op`). On the same
rank processes, for each stage, both engines train their own float32 copy of the GPT from the
same seed on the same batches (AdamW, torch's on both sides: DeepSpeed's "torch_adam": true),
one optimizer step at a time, alternating which goes first, so that changes in the machine's
load hit both alike. The first two steps of each are warm-up and dropped. A step is, on
tinyscale's side, `engine.train_batch(batch)`; on DeepSpeed's, `engine(x, y)`,
`engine.backward(loss)` and `engine.step()` over this rank's micro-batches (the rows tinyscale
gives this rank); every rank times each after a barrier, and a step's time is its slowest
rank's (`tinyscale.bench.slowest`, as the other benchmarks).

It prints the median step time of each (and the spread, fastest .. slowest), the ratio
tinyscale / DeepSpeed (below 1: tinyscale is faster) with its 95% bootstrap interval over the
paired steps (`tinyscale.bench.ratio_interval`: a step of each engine is one round) and the
median of each round's ratio, and checks that the losses agree: both
train in float32 and reduce in different orders, and Adam can turn rounding-level gradients
into updates of either sign, so the check is 1e-3 relative (a wrong gradient scale or a lost
micro-batch moves the loss by far more within a few steps). It also prints what each step cost
in CPU time, both ranks' processes summed (every thread, gloo's too), and that ratio with its
interval: with 2 ranks on 2 cores a step's wall time is about its CPU work, and the CPU time is
what the machine's other load moves least (lesson 12). --json writes the ratios under
`zero0_vs_deepspeed` .. `zero3_vs_deepspeed`, their intervals and each step's milliseconds
(wall, and CPU under `cpu_step_ms` with `cpu_intervals`).
`--stages 0,1` times those stages only. Tests: `pytest -k deepspeed_agreement`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys

from rich.console import Console
from rich.table import Table

from tinyscale.bench import add_json_argument, interval_verdict, ratio_interval, write_json
from tinyscale.data import sample_batches, stdlib_corpus
from tinyscale.models import GPTConfig
from tinyscale.testing import deepspeed_peer

WARMUP = 2
LOSS_REL = 1e-3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", default="small", choices=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per engine and stage (after 2 warm-up)")
    parser.add_argument("--micro", type=int, default=4, help="rows per rank per step")
    parser.add_argument("--stages", default="0,1,2,3")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    console = Console()
    if not deepspeed_peer.available():
        console.print("DeepSpeed is not installed, so nothing is measured: pip install -e '.[peers]' "
                      "(make setup does), then rerun")
        write_json(args.json, {}, skipped="DeepSpeed is not installed (the peers extra)")
        return 0
    cfg = GPTConfig.preset(args.model)
    seq = min(cfg.max_seq_len, 128)
    rows = args.micro * args.world_size
    batches = sample_batches(stdlib_corpus().tokens, num_batches=WARMUP + args.steps, batch_size=rows,
                             seq_len=seq, seed=0)
    stages = [int(s) for s in args.stages.split(",")]
    payload = {
        "world_size": args.world_size, "stages": stages, "seed": 0, "dtype": "float32", "interleave": True,
        "parameters": False, "model": dataclasses.asdict(cfg), "timeout_s": 3000,
        "batches": [[t.tolist() for t in b] for b in batches],
        "config": {"train_batch_size": rows, "train_micro_batch_size_per_gpu": args.micro,
                   "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                   "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}},
    }
    console.print(f"GPT {args.model} ({cfg.num_params():,} parameters), {args.world_size} ranks, "
                  f"{args.micro} x {seq} tokens per rank per step, {args.steps} timed steps (+{WARMUP} warm-up)")
    result = deepspeed_peer.run("train", payload, timeout_s=3600)

    table = Table(title="one training step (its slowest rank), median (fastest .. slowest)")
    for col in ("ZeRO stage", "tinyscale ms", "DeepSpeed ms", "tinyscale / DeepSpeed", "CPU ratio",
                "loss max rel. diff"):
        table.add_column(col, justify="right")
    ratios, intervals, step_ms, verdicts, ok = {}, {}, {}, [], True
    cpu_intervals, cpu_step_ms = {}, {}
    for stage in stages:
        runs = result[str(stage)]
        ours, theirs = (runs[side]["seconds"][WARMUP:] for side in ("tinyscale", "deepspeed"))
        diff = max(abs(a - b) / abs(b) for a, b in zip(runs["tinyscale"]["losses"], runs["deepspeed"]["losses"]))
        ok &= diff < LOSS_REL and all(map(math.isfinite, runs["tinyscale"]["losses"]))
        key = f"zero{stage}_vs_deepspeed"
        ratio = statistics.median(ours) / statistics.median(theirs)
        ratios[key] = round(ratio, 3)
        low, high = intervals[key] = ratio_interval(ours, theirs)
        each = statistics.median([a / b for a, b in zip(ours, theirs)])
        intervals[key + "_per_round"] = (each, *ratio_interval(ours, theirs, per_round=True))
        step_ms[key] = {side: [round(1e3 * t, 3) for t in times]
                        for side, times in (("tinyscale", ours), ("deepspeed", theirs))}
        verdicts.append(f"{key}: {ratio:.3f}x, 95% interval {low:.3f} .. {high:.3f} over {len(ours)} paired steps: "
                        f"{interval_verdict(low, high, 'tinyscale')}; the median of each step's ratio {each:.3f}x")
        cpu_ours, cpu_theirs = (runs[side]["cpu_seconds"][WARMUP:] for side in ("tinyscale", "deepspeed"))
        cpu_ratio = statistics.median(cpu_ours) / statistics.median(cpu_theirs)
        cpu_intervals[key] = (cpu_ratio, *ratio_interval(cpu_ours, cpu_theirs))
        cpu_step_ms[key] = {side: [round(1e3 * t, 3) for t in times]
                            for side, times in (("tinyscale", cpu_ours), ("deepspeed", cpu_theirs))}
        verdicts.append(f"  CPU time a step, both ranks summed: {1e3 * statistics.median(cpu_ours):.1f} against "
                        f"{1e3 * statistics.median(cpu_theirs):.1f} ms, {cpu_ratio:.3f}x, 95% interval "
                        f"{cpu_intervals[key][1]:.3f} .. {cpu_intervals[key][2]:.3f}")
        table.add_row(str(stage), *(f"{1e3 * statistics.median(t):.1f} ({1e3 * min(t):.1f} .. {1e3 * max(t):.1f})"
                                    for t in (ours, theirs)), f"{ratio:.2f}x", f"{cpu_ratio:.2f}x", f"{diff:.1e}")
    console.print(table)
    for line in verdicts:
        console.print(line)
    write_json(args.json, ratios, world_size=args.world_size, model=args.model, steps=args.steps,
               intervals={k: [round(v, 4) for v in iv] for k, iv in intervals.items()}, step_ms=step_ms,
               cpu_intervals={k: [round(v, 4) for v in iv] for k, iv in cpu_intervals.items()}, cpu_step_ms=cpu_step_ms)
    if not ok:
        console.print(f"[red]the losses differ by more than {LOSS_REL:g} relative[/red]")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
