"""`tinyscale autotune`: short trials of the planner's best layouts on the ranks at hand.

    tinyscale autotune --config ds.json --world-size 2 [--model small] [--seq-len 64] [--trials 4]
                       [--steps 3] [--time-limit 60] [--memory-limit-mb 0] [--out autotune_best.json]
                       [--peak-gflops G] [--link-latency-us A] [--link-gbps B] [--host-overhead-ms H]

DeepSpeed's autotuner (deepspeed/autotuning) is the anchor: it reads the user's config, explores
ZeRO stages and micro-batch sizes with short experiments, measures throughput and writes the
best config. Here the planner proposes the candidates (every layout of the world, ranked by its
model of this machine), so the trials go to the layouts most likely to win; the user's own
config runs first as the baseline. Each trial is its own launch of the ranks (`dist.launch`),
so a trial that fails cannot take the next with it: one that runs out of memory (CUDA's
OutOfMemoryError, or over `--memory-limit-mb` by `engine.memory_report`, agreed over the ranks)
or out of time (over `--time-limit` seconds, agreed over the ranks after each step) stops, is
marked, and the next one runs. The winner is the highest measured tokens/s; its config (the
user's, with the layout's keys replaced) is written to `--out`, the table of trials printed.

The planner ranks the candidates with this machine measured at start (`planner/measure.py`:
the matmul peak, gloo's all-reduce alpha and beta, the host's overhead per layer, on the ranks
of the trials), printed before the trials; `--peak-gflops`, `--link-latency-us`, `--link-gbps`
and `--host-overhead-ms` give a value instead (all four: nothing is measured).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time

import torch

from tinyscale.planner.cluster import Cluster
from tinyscale.planner.estimate import Layout, estimate
from tinyscale.planner.measure import MEASURED_KEYS, cpu_cluster, describe, measure_machine
from tinyscale.planner.search import plan

LAYOUT_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization",
               "activation_checkpointing", "parallel")


def layout_of_config(config: dict, world: int) -> Layout:
    """The `Layout` a config describes on `world` ranks (the baseline trial)."""
    par = config.get("parallel", {})
    tp, pp, cp = par.get("tensor", 1), par.get("pipeline", 1), par.get("context", 1)
    zero = config.get("zero_optimization", {})
    return Layout(dp=world // (tp * pp * cp), tp=tp, pp=pp, cp=cp, virtual_stages=par.get("virtual_stages", 1),
                  schedule=par.get("pipeline_schedule", "1f1b"), zero_stage=zero.get("stage", 0),
                  offload=zero.get("offload_optimizer", {}).get("device", "none"),
                  policy=config.get("activation_checkpointing", {}).get("policy", "none"),
                  micro_batch=config.get("train_micro_batch_size_per_gpu", 1),
                  sequence_parallel=par.get("sequence_parallel", False) if tp > 1 else None,
                  ep=par.get("expert", 1))


def trial_config(base: dict, lay: Layout) -> dict:
    """`base` with the layout's keys replaced by `lay`'s (the rest, optimizer and all, kept)."""
    out = {k: v for k, v in copy.deepcopy(base).items() if k not in LAYOUT_KEYS}
    made = lay.config(base["train_batch_size"])
    zero = {**base.get("zero_optimization", {}), **made["zero_optimization"]}
    if lay.offload == "none":
        zero.pop("offload_optimizer", None)
    return out | made | {"zero_optimization": zero}


def run_trial(model_config, config: dict, seq_len: int, steps: int, time_limit_s: float,
              memory_limit: float) -> dict:
    """On every rank: build the engine, warm up one step, time up to `steps` more. Returns
    {"status", "steps", "seconds", "memory"}; stops early (agreed over the ranks) on time or memory."""
    import torch.distributed as dist

    import tinyscale as ts
    from tinyscale.data import synthetic_token_batches
    from tinyscale.models import GPT

    engine = ts.initialize(GPT(model_config, seed=0), config)
    batches = synthetic_token_batches(num_batches=steps + 1, batch_size=config["train_batch_size"], seq_len=seq_len,
                                      vocab_size=model_config.vocab_size, seed=0)

    def agreed_max(x: float) -> float:
        if not dist.is_initialized():
            return x
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    start = time.perf_counter()
    engine.train_batch(batches[0])  # warm-up: not timed
    memory = agreed_max(engine.memory_report().total)
    if memory_limit and memory > memory_limit:
        return {"status": "out of memory", "steps": 0, "seconds": 0.0, "memory": memory}
    timed, done = 0.0, 0
    for batch in batches[1:]:
        if agreed_max(time.perf_counter() - start) > time_limit_s:
            return {"status": "out of time", "steps": done, "seconds": timed, "memory": memory}
        t0 = time.perf_counter()
        engine.train_batch(batch)
        timed += agreed_max(time.perf_counter() - t0)
        done += 1
    return {"status": "ok", "steps": done, "seconds": timed, "memory": memory}


@dataclasses.dataclass
class Trial:
    layout: Layout
    config: dict
    predicted_s: float
    status: str = "not run"
    tokens_per_s: float = 0.0
    step_s: float = 0.0
    memory: float = 0.0


def candidates(model_config, base: dict, world: int, seq_len: int, trials: int, cluster: Cluster) -> list[Trial]:
    """The user's layout, then the planner's fastest distinct layouts, `trials` in all."""
    batch = base["train_batch_size"]
    own = layout_of_config(base, world)
    kw = dict(global_batch=batch, seq_len=seq_len, dtype_bytes=4, compute_bytes=None)
    out = [Trial(own, trial_config(base, own), estimate(model_config, own, cluster, **kw).time.get("total", 0.0))]
    ranked = plan(model_config, cluster, refine=max(trials, 8), max_tp=world, **kw).ranked
    for est in ranked:
        if len(out) >= trials:
            break
        if est.layout != own:
            out.append(Trial(est.layout, trial_config(base, est.layout), est.time["total"]))
    return out


def _default_runner(time_limit_s: float):
    from tinyscale import dist

    return lambda fn, n, *a: dist.launch(fn, n, *a, timeout_s=time_limit_s * 4 + 120)


def machine(model_config, world: int, *, given: dict | None = None, runner=None) -> dict:
    """`measure_machine`'s dict for `world` ranks of this machine, measured on them (one launch),
    with `given` values (same keys) in place of measured ones; all four given: no launch."""
    given = {k: v for k, v in (given or {}).items() if v is not None}
    unknown = set(given) - set(MEASURED_KEYS)
    if unknown:
        raise ValueError(f"unknown machine values {sorted(unknown)}: use {', '.join(MEASURED_KEYS)}")
    if set(given) == set(MEASURED_KEYS):
        return dict(given)
    measured = (runner or _default_runner(60.0))(measure_machine, world, model_config)[0]
    return measured | given


def autotune(model_config, base: dict, world: int, *, seq_len: int, trials: int = 4, steps: int = 3,
             time_limit_s: float = 60.0, memory_limit: float = 0.0, runner=None, cluster: Cluster | None = None):
    """Run the trials (see the module doc); returns (trials in the order run, the best or None).
    `runner(fn, world, *args)` runs fn on the ranks (default `dist.launch`, one launch per trial).
    Without `cluster`, the planner plans for this machine, measured on the ranks first (`machine`)."""
    runner = runner or _default_runner(time_limit_s)
    model_config = model_config.with_(max_seq_len=max(seq_len, model_config.max_seq_len))
    cluster = cluster or cpu_cluster(world, machine(model_config, world, runner=runner))
    done = []
    for trial in candidates(model_config, base, world, seq_len, trials, cluster):
        try:
            result = runner(run_trial, world, model_config, trial.config, seq_len, steps, time_limit_s, memory_limit)[0]
        except Exception as exc:  # noqa: BLE001 - a failed trial is recorded, the next one runs
            oom = "out of memory" in str(exc).lower() or isinstance(exc, torch.OutOfMemoryError)
            trial.status = "out of memory" if oom else f"failed: {str(exc).splitlines()[0][:80]}"
            done.append(trial)
            continue
        trial.status, trial.memory = result["status"], result["memory"]
        if result["steps"]:
            trial.step_s = result["seconds"] / result["steps"]
            trial.tokens_per_s = base["train_batch_size"] * seq_len / trial.step_s
        done.append(trial)
    ok = [t for t in done if t.status == "ok"]
    return done, max(ok, key=lambda t: t.tokens_per_s, default=None)


def add_parser(sub) -> None:
    p = sub.add_parser("autotune", help="short trials of the planner's best layouts; writes the fastest config")
    p.add_argument("--config", required=True, help="the engine/DeepSpeed config to tune (.json or .yaml)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--model", default="small", help="a GPT preset (tiny, small) or sizes layers=..,d_model=..")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="timed steps per trial (after one warm-up)")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds per trial before it is stopped")
    p.add_argument("--memory-limit-mb", type=float, default=0.0, help="per rank; 0: no limit but the device's")
    p.add_argument("--out", default="autotune_best.json")
    p.add_argument("--peak-gflops", type=float, help="matmul FLOP/s per rank the planner assumes (default: measured)")
    p.add_argument("--link-latency-us", type=float, help="all-reduce alpha between ranks (default: measured)")
    p.add_argument("--link-gbps", type=float, help="all-reduce beta, GB/s per rank (default: measured)")
    p.add_argument("--host-overhead-ms", type=float, help="host work per layer per pass (default: measured)")


def cmd_autotune(args, console) -> int:
    from rich.table import Table

    from tinyscale.config import EngineConfig
    from tinyscale.models.config import PRESETS
    from tinyscale.planner.models import resolve_model

    base = EngineConfig.load(args.config).model_dump(exclude_defaults=True)
    model = PRESETS[args.model] if args.model in PRESETS else resolve_model(args.model)
    scale = {"peak": (args.peak_gflops, 1e9), "alpha": (args.link_latency_us, 1e-6), "beta": (args.link_gbps, 1e9),
             "launch": (args.host_overhead_ms, 1e-3)}
    given = {k: v * unit for k, (v, unit) in scale.items() if v is not None}
    model_for_machine = model.with_(max_seq_len=max(args.seq_len, model.max_seq_len))
    found = machine(model_for_machine, args.world_size, given=given, runner=_default_runner(args.time_limit))
    console.print(f"this machine, {args.world_size} ranks: {describe(found, set(given))}")
    done, best = autotune(model, base, args.world_size, seq_len=args.seq_len, trials=args.trials, steps=args.steps,
                          time_limit_s=args.time_limit, memory_limit=args.memory_limit_mb * 2**20,
                          cluster=cpu_cluster(args.world_size, found))
    table = Table(title=f"tinyscale autotune: {len(done)} trials on {args.world_size} ranks")
    for col in ("#", "layout", "status", "tokens/s", "step ms", "planned ms", "MiB/rank"):
        table.add_column(col)
    for i, t in enumerate(done):
        table.add_row(str(i + 1) + (" (yours)" if i == 0 else ""), t.layout.describe(),
                      ("[green]best[/green] " if t is best else "") + t.status,
                      f"{t.tokens_per_s:,.0f}" if t.tokens_per_s else "-", f"{t.step_s * 1e3:.1f}" if t.step_s else "-",
                      f"{t.predicted_s * 1e3:.1f}", f"{t.memory / 2**20:.1f}" if t.memory else "-")
    console.print(table)
    if best is None:
        console.print("[red]no trial finished[/red]: raise --time-limit or --memory-limit-mb")
        return 1
    with open(args.out, "w") as f:
        json.dump(best.config, f, indent=1)
    console.print(f"wrote {args.out} ({best.layout.describe()}, {best.tokens_per_s:,.0f} tokens/s)")
    return 0
