"""`tinyscale`: the command line.

    tinyscale train --preset ddp --world-size 4 [--steps 20] [--config FILE] [--dtype float64]
    tinyscale estimate --params 7.5e9 [--dp 1 4 16 64] [--zero 3] [--offload cpu]
    tinyscale plan --model llama2-70b --gpus 512 [--global-batch 1024 --seq-len 4096] [--json]
    tinyscale autotune --config ds.json [--world-size 2] [--trials 4] [--out autotune_best.json]
    tinyscale elastic --global-batch 1024 --micro-batches 1,2,4 [--model-parallel 16]
    tinyscale info
    tinyscale exercise list | start TOPIC | check TOPIC
    tinyscale quiz [--topic T] [--count N] [--seed S]

`train` spawns CPU ranks on this machine (or, started by torchrun, joins its ranks), trains
the GPT on the standard library's sources with a progress bar, trains the single-process
reference on the same batches, and prints a summary: final losses, the largest parameter
difference, bytes communicated per op and model-state bytes per rank. It writes
``metrics.jsonl``, ``summary.json`` and ``loss.png`` into the run directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

# The verdict: our parameters must be as close to the reference as two single-process runs
# that only sum in a different order are to each other (the noise floor, measured on the
# same run), with 10x headroom, and never further than 1e-12 when that floor is ~0. In
# float64 a real bug (a missing 1/N, a dropped micro-batch) lands orders of magnitude above
# it. In float32 the floor itself is large (Adam amplifies rounding wherever a gradient is
# near zero): there we report and do not judge.
_NOISE_HEADROOM = 10.0
_ABSOLUTE_FLOOR = 1e-12


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n:.2f}"


def _write_outputs(run_dir: Path, spec, result: dict, ref: dict | None, summary: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for i, row in enumerate(result["metrics"]):
            if ref is not None:
                row = {**row, "reference_loss": ref["losses"][i]}
            f.write(json.dumps(row) + "\n")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [m["step"] for m in result["metrics"]]
    ax.plot(steps, [m["loss"] for m in result["metrics"]], label=f"{spec.preset}, {spec.world_size} ranks")
    if ref is not None:
        ax.plot(steps, ref["losses"], "--", label="single-process reference")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title(f"tinyscale train --preset {spec.preset} ({spec.model} GPT, {spec.dtype})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=120)
    plt.close(fig)


def _utilization(spec, tokens_per_s: float, result: dict) -> dict:
    """MFU and HFU of the run's throughput (steps after the first), `tinyscale.mfu`'s formulas."""
    from tinyscale.config import EngineConfig
    from tinyscale.engine.throughput import early_stop_of, explicit_core_of, recompute_of
    from tinyscale.mfu import hfu, mfu
    from tinyscale.models import GPTConfig

    cfg, peak, devices = GPTConfig.preset(spec.model), result["peak_flops"], result["num_devices"]
    engine_config = EngineConfig.load(spec.config)
    recompute, layers = recompute_of(engine_config, cfg.n_layer)
    par = engine_config.parallel
    source = "vendor table" if result["backend"] == "nccl" else "measured matmul peak of this CPU"
    return {"mfu": mfu(tokens_per_s, cfg, peak, num_devices=devices),
            "hfu": hfu(tokens_per_s, cfg, peak, num_devices=devices, recompute=recompute, recomputed_layers=layers,
                       early_stop=early_stop_of(engine_config, cfg, tp=par.tensor),
                       explicit_core=explicit_core_of(engine_config, cfg, tp=par.tensor,
                                                      device="cuda" if result["backend"] == "nccl" else "cpu"),
                       tp=par.tensor, cp=par.context, cp_algorithm=par.context_algorithm,
                       cp_sharding=par.context_sharding),
            "peak_flops": peak, "peak_source": source}


def _summary_table(spec, result: dict, ref: dict | None) -> tuple[Table, dict]:
    metrics = result["metrics"]
    timed = metrics[1:] or metrics  # the first step pays for warm-up
    tok_s = sum(m["tokens"] for m in timed) / sum(m["step_time_s"] for m in timed)
    summary = {
        "preset": spec.preset, "world_size": spec.world_size, "backend": result["backend"],
        "model": spec.model, "num_params": result["num_params"], "dtype": spec.dtype, "steps": spec.steps,
        "final_loss": metrics[-1]["loss"], "tokens_per_s": tok_s,
        "comm": result["ledger"], "memory_per_rank": result["memory"],
    }
    table = Table(title=f"tinyscale train --preset {spec.preset}", show_header=True)
    table.add_column("", style="bold")
    table.add_column("value", justify="right")
    table.add_row("ranks / backend", f"{spec.world_size} / {result['backend']}")
    table.add_row("model", f"{spec.model} GPT, {result['num_params']:,} params, {spec.dtype}")
    table.add_row("final loss", f"{metrics[-1]['loss']:.6f}")
    if ref is not None:
        tol = max(_NOISE_HEADROOM * ref["noise_floor"], _ABSOLUTE_FLOOR) if spec.dtype == "float64" else None
        matches = None if tol is None else ref["max_param_diff"] <= tol
        summary |= {"reference_final_loss": ref["losses"][-1], "max_loss_diff": ref["max_loss_diff"],
                    "max_param_diff": ref["max_param_diff"], "noise_floor": ref["noise_floor"],
                    "matches_reference": matches, "tolerance": tol}
        table.add_row("reference final loss (1 process)", f"{ref['losses'][-1]:.6f}")
        table.add_row("max |loss - reference| over steps", f"{ref['max_loss_diff']:.3e}")
        table.add_row("noise floor (1 process, other summation order)", f"{ref['noise_floor']:.3e}")
        if tol is None:
            verdict = f"({spec.dtype}: reported, not judged; --dtype float64 to check)"
        else:
            verdict = ("[green]matches[/green]" if matches else "[red]DIFFERS[/red]") + f" (tol {tol:.1e})"
        table.add_row("max |param - reference|", f"{ref['max_param_diff']:.3e}  {verdict}")
    table.add_row("throughput", f"{tok_s:,.0f} tokens/s ({metrics[-1]['step_time_s'] * 1e3:.0f} ms last step)")
    if result.get("peak_flops"):
        summary |= _utilization(spec, tok_s, result)
        table.add_row("MFU / HFU", f"{summary['mfu']:.2%} / {summary['hfu']:.2%} of {summary['peak_flops'] / 1e9:,.1f} "
                                   f"GFLOP/s x {result['num_devices']} ({summary['peak_source']})")
    for op, row in result["ledger"].items():
        per_step = "once, at start" if op == "broadcast" else f"{_fmt_bytes(row['bytes'] / spec.steps)}/step"
        calls = f"{row['calls']:,} call" + ("s" if row["calls"] != 1 else "")
        table.add_row(f"comm {op}", f"{_fmt_bytes(row['bytes'])} in {calls} ({per_step})")
    if not result["ledger"]:
        table.add_row("comm", "none (one process)")
    mem = result["memory"]
    states = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in mem.items() if k != "total" and v)
    table.add_row("model state per rank", f"{_fmt_bytes(mem['total'])} ({states})")
    return table, summary


def cmd_train(args: argparse.Namespace, console: Console) -> int:
    from tinyscale import dist
    from tinyscale.config import EngineConfig
    from tinyscale.train import compare_with_reference, make_spec, train_rank

    config = None
    if args.config:
        config = EngineConfig.load(args.config).model_dump(exclude_defaults=True)
    torchrun = _under_torchrun()
    import dataclasses

    import torch
    world_size = int(os.environ["WORLD_SIZE"]) if torchrun else args.world_size
    spec = make_spec(args.preset, world_size=world_size, steps=args.steps, config=config,
                     model=args.model, dtype=args.dtype, seed=args.seed, save_dir=args.save_dir,
                     save_every=args.save_every, resume=args.resume)
    if not torch.cuda.is_available():  # a CPU has no vendor peak: measure one for MFU (~1 s)
        from tinyscale.mfu import measured_peak
        from tinyscale.train import DTYPES

        spec = dataclasses.replace(spec, peak_flops=measured_peak("cpu", DTYPES[spec.dtype], max_seconds=1.0))
    if torchrun:
        dist.init(timeout_s=args.timeout)
        result = train_rank(spec)
        if dist.rank() != 0:
            return 0
    elif spec.world_size == 1:
        result = train_rank(spec)
    elif args.resume_on_failure:
        from tinyscale.recovery import train_with_recovery

        console.print(f"launching {spec.world_size} ranks, restarting at most {args.resume_on_failure} times...")
        result, _ = train_with_recovery(spec, max_restarts=args.resume_on_failure, timeout_s=args.timeout,
                                        log=console.print)
    else:
        console.print(f"launching {spec.world_size} ranks (gloo on CPU unless there is a GPU per rank)...")
        result = dist.launch(train_rank, spec.world_size, spec, timeout_s=args.timeout)[0]
    ref = None if args.no_reference else compare_with_reference(spec, result)
    table, summary = _summary_table(spec, result, ref)
    console.print(table)
    run_dir = Path(args.run_dir or f"runs/{spec.preset}-x{spec.world_size}-{time.strftime('%Y%m%d-%H%M%S')}")
    _write_outputs(run_dir, spec, result, ref, summary)
    console.print(f"wrote {run_dir}/metrics.jsonl, summary.json and loss.png")
    return 1 if ref is not None and summary["matches_reference"] is False else 0


def cmd_info(args: argparse.Namespace, console: Console) -> int:
    import torch

    from tinyscale.data import corpus_info
    from tinyscale.dist import resolve_backend

    table = Table(title="tinyscale info", show_header=False)
    table.add_row("torch", torch.__version__)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    table.add_row("GPUs", str(gpus) + (f" ({torch.cuda.get_device_name(0)})" if gpus else ""))
    table.add_row("backend for 4 ranks", resolve_backend("auto", 4))
    table.add_row("CPU cores", str(os.cpu_count()))
    for key, value in corpus_info().items():
        if isinstance(value, dict):
            value = ", ".join(f"{v:,} {k}" for k, v in value.items())
        table.add_row(f"corpus {key}", str(value))
    console.print(table)
    return 0


def cmd_estimate(args: argparse.Namespace, console: Console) -> int:
    import math

    from tinyscale.zero import estimate as est

    def gb(nbytes: float) -> str:  # rounded as the paper's Table 1 rounds; tiny values keep 3 digits
        value = nbytes / est.GB
        if 0 < value < 0.005:
            return f"{value:.3g}"
        return f"{est.round_like_paper(value):,.2f}".rstrip("0").rstrip(".")

    if args.preset:
        from tinyscale.models import GPTConfig

        num_params, source = GPTConfig.preset(args.preset).num_params(), f"GPT preset {args.preset}"
    else:
        num_params = 7.5e9 if args.params is None else args.params
        source = "the ZeRO paper's example" if args.params is None else "--params"
    if not (math.isfinite(num_params) and num_params >= 0):
        raise ValueError(f"--params {args.params} is not a parameter count: give a number >= 0, "
                         "e.g. --params 7.5e9")
    if min(args.dp) < 1:
        raise ValueError(f"--dp {min(args.dp)}: a data-parallel degree is at least 1, e.g. --dp 1 8 64")
    if args.zero is not None and args.zero not in est.STAGES:
        raise ValueError(f"--zero {args.zero} is not a ZeRO stage: use 0 (DDP), 1, 2 or 3")
    # Offload needs the stage that shards what it moves: the optimizer (with its gradient
    # shard) from stage 2 on (ZeRO-Offload), the parameters at stage 3 (ZeRO-Infinity).
    lowest = 3 if args.offload_params != "none" else 2 if args.offload != "none" else 0
    if args.zero is not None and args.zero < lowest:
        flag = "--offload-params" if lowest == 3 else "--offload"
        raise ValueError(f"{flag} needs --zero {'3' if lowest == 3 else '2 or 3'} (got --zero {args.zero}): "
                         "offload moves the shards that those stages create")
    stages = [args.zero] if args.zero is not None else [s for s in est.STAGES if s >= lowest]
    offloading = lowest > 0
    placement = dict(offload=args.offload, offload_params=args.offload_params)

    console.print(f"Ψ = {num_params:,.0f} parameters ({source}), N = data-parallel degree (--dp), "
                  "GB = 1e9 bytes, mixed-precision Adam (2 + 2 + 12 bytes per parameter)")
    share = "; host and disk: this rank's share" if offloading else ""
    memory = Table(title="ZeRO model states per rank (GB)",
                   caption=f"Rounded like the paper's Table 1{share}. Not counted (not model states): "
                           "activations, temporary buffers, fragmentation.")
    memory.add_column("stage", style="bold")
    if offloading:
        memory.add_column("on")
    memory.add_column("bytes per rank")
    for dp in args.dp:
        memory.add_column(f"N={dp}", justify="right", no_wrap=True)
    for stage in stages:
        rows = [(loc, est.formula(stage, loc, **placement)) for loc in est.LOCATIONS]
        rows = [(loc, text) for loc, text in rows if loc == "device" or text != "0"]
        for i, (loc, text) in enumerate(rows):
            cells = [gb(est.model_state_bytes(num_params, dp, stage, **placement).bytes(location=loc))
                     for dp in args.dp]
            label = f"{stage} {est.STAGE_NAMES[stage]}" if i == 0 else ""
            memory.add_row(label, *([loc] if offloading else []), text, *cells)
    console.print(memory)

    comm = Table(title="Data-parallel communication per rank per step (one micro-batch)",
                 caption="As the paper counts it: each reduce-scatter or all-gather moves Ψ elements.")
    ring = Table(title="The same exactly, for ring collectives over N ranks (GB of fp16)",
                 caption="A ring reduce-scatter or all-gather sends (N-1)/N of Ψ per rank; the paper "
                         "rounds that to Ψ. This is what Ledger.bus_bytes() measures.")
    for table, heading in ((comm, "collectives"), (ring, "elements per rank")):
        table.add_column("stage", style="bold")
        table.add_column(heading)
    comm.add_column("volume", justify="right")
    comm.add_column("GB fp16", justify="right", no_wrap=True)
    for dp in args.dp:
        ring.add_column(f"N={dp}", justify="right", no_wrap=True)
    for stage in stages:
        label, k = f"{stage} {est.STAGE_NAMES[stage]}", est.comm_volume(1, stage)
        comm.add_row(label, est.COLLECTIVES[stage], f"{k:g}Ψ", gb(2 * est.comm_volume(num_params, stage)))
        ring.add_row(label, f"{k:g}Ψ(N-1)/N",
                     *[gb(est.comm_bytes_per_rank(num_params, stage, dp, 2)) for dp in args.dp])
    console.print(comm)
    console.print(ring)
    return 0


def cmd_checkpoint(args, console: Console) -> int:
    """`tinyscale checkpoint export DIR OUT.pt` / `import IN.pt DIR` (engine/dcp_checkpoint.py)."""
    from tinyscale.engine import dcp_checkpoint

    if args.checkpoint_command == "export":
        meta = dcp_checkpoint.export(args.directory, args.out)
        console.print(f"wrote {args.out}: the whole model at step {meta.get('step')}")
    else:
        version = dcp_checkpoint.import_file(args.file, args.directory)
        console.print(f"wrote {version}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from tinyscale.models import PRESETS as MODEL_PRESETS
    from tinyscale.train import DTYPES, PRESETS
    from tinyscale.zero.estimate import OFFLOAD_TARGETS, TABLE1_DPS

    parser = argparse.ArgumentParser(prog="tinyscale", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train the GPT on N ranks and compare with one process")
    t.add_argument("--preset", default="ddp", choices=sorted(PRESETS), help="layout and recipe (default: ddp)")
    t.add_argument("--world-size", type=int, default=None, help="ranks to spawn (default: the preset's)")
    t.add_argument("--steps", type=int, default=20, help="optimizer steps (default: 20: the demo, with its single-process proof, in about a minute on 2 cores)")
    t.add_argument("--config", help="engine config (.json/.yaml, DeepSpeed keys) replacing the preset's")
    t.add_argument("--model", choices=[m for m in MODEL_PRESETS if m in ("tiny", "small")],
                   help="GPT preset (default: the preset's)")
    t.add_argument("--dtype", choices=sorted(DTYPES),
                   help="parameter dtype (default: the preset's, float64, where equivalence is exact)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--save-dir", help="checkpoint directory, written at the end (and every --save-every steps)")
    t.add_argument("--save-every", type=int, default=0, help="also save every N steps (default: only at the end)")
    t.add_argument("--resume", action="store_true",
                   help="continue from --save-dir's checkpoint: its step, its next batch, its random state")
    t.add_argument("--resume-on-failure", type=int, default=0, metavar="N",
                   help="after a crash, relaunch from the latest checkpoint, at most N times (needs --save-every)")
    t.add_argument("--run-dir", help="where to write metrics.jsonl, summary.json, loss.png")
    t.add_argument("--no-reference", action="store_true", help="skip the single-process comparison")
    t.add_argument("--timeout", type=float, default=3600, help="seconds before a stuck run is stopped")
    sub.add_parser("info", help="this machine, the backend tinyscale picks, and the corpus")
    e = sub.add_parser("estimate", help="ZeRO's model-state memory per device and communication per step")
    size = e.add_mutually_exclusive_group()
    size.add_argument("--params", type=float, help="parameters Ψ, e.g. 7.5e9 (default: 7.5e9, the paper's)")
    size.add_argument("--preset", choices=sorted(MODEL_PRESETS), help="take Ψ from a GPT preset's shapes")
    e.add_argument("--dp", type=int, nargs="+", default=list(TABLE1_DPS),
                   help="data-parallel degrees N (default: the paper's 1 4 16 64 256 1024)")
    e.add_argument("--zero", type=int, help="only this stage: 0 (DDP), 1, 2 or 3 (default: all)")
    e.add_argument("--offload", choices=OFFLOAD_TARGETS, default="none",
                   help="optimizer states, master weights and gradient shard to host memory (cpu) "
                        "or disk (nvme): ZeRO-Offload, stages 2 and 3")
    e.add_argument("--offload-params", choices=OFFLOAD_TARGETS, default="none",
                   help="the parameter shard to host memory or disk: ZeRO-Infinity, stage 3")
    c = sub.add_parser("checkpoint", help="a checkpoint to one torch.save file and back (export / import)")
    csub = c.add_subparsers(dest="checkpoint_command", required=True)
    ex = csub.add_parser("export", help="DIR (any layout wrote it) -> one torch.save file of the whole model")
    ex.add_argument("directory")
    ex.add_argument("out")
    im = csub.add_parser("import", help="a torch.save file (export's, or a model state_dict) -> a checkpoint in DIR")
    im.add_argument("file")
    im.add_argument("directory")
    from tinyscale.course import exercise, quiz
    from tinyscale.planner import autotune as plan_autotune
    from tinyscale.planner import report as plan_report

    plan_report.add_parser(sub)
    plan_autotune.add_parser(sub)
    from tinyscale import recovery

    recovery.add_parser(sub)
    exercise.add_parser(sub)
    quiz.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    console = Console()
    args = build_parser().parse_args(argv)
    try:
        from tinyscale.course.exercise import cmd_exercise
        from tinyscale.course.quiz import cmd_quiz

        from tinyscale.planner.autotune import cmd_autotune
        from tinyscale.planner.report import cmd_plan

        commands = {"train": cmd_train, "info": cmd_info, "estimate": cmd_estimate, "exercise": cmd_exercise,
                    "quiz": cmd_quiz, "plan": cmd_plan, "autotune": cmd_autotune, "checkpoint": cmd_checkpoint}
        from tinyscale.recovery import cmd_elastic

        commands["elastic"] = cmd_elastic
        return commands[args.command](args, console)
    except ValueError as err:  # bad input: say what and how to fix it, no traceback
        console.print(f"[red]error:[/red] {err}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
