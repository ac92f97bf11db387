"""The training job behind `tinyscale train`: the GPT on the standard library's sources.

Every rank builds the same model (same seed) and the same list of global batches (same
seed), and the engine trains on them. Afterwards the single-process reference trains a
fresh copy on the same batches, and the summary compares the two: if the layout is
correct, the losses and the parameters agree (to rounding: exactly, in float64).

Run it three ways:

    tinyscale train --preset ddp --world-size 4                  # spawns 4 CPU ranks here
    torchrun --nproc-per-node 4 -m tinyscale.train --preset ddp  # ranks started by torchrun
    python -m tinyscale.train --preset single                    # one process
"""

from __future__ import annotations

import dataclasses
import tempfile
import time

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import tinyscale as ts
from tinyscale.data import sample_batches, stdlib_corpus
from tinyscale.engine import parallelize
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing.equivalence import max_abs_diff

# Presets: a model, a per-rank batch recipe and a default world size. The global batch is
# micro x accumulation x world size rows, so any world size works.
_COMMON = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 10, "warmup_type": "linear"}},
}
# float64 by default: these presets exist to show that a layout trains exactly like one
# process, and in float64 "exactly" is visible (differences ~1e-13, not ~1e-4).
PRESETS: dict[str, dict] = {
    "single": {"model": "small", "world_size": 1, "dtype": "float64", "config": _COMMON},
    # Buckets of at most 131,072 elements (1 MiB in float64), closed at parameter boundaries: the
    # small GPT's gradients go in 9 all-reduces that overlap backward (lesson 0 counts them;
    # tests/docs/test_docs_figures.py). DeepSpeed's default (5e8) would make one.
    "ddp": {"model": "small", "world_size": 4, "dtype": "float64",
            "config": {**_COMMON, "zero_optimization": {"stage": 0, "reduce_bucket_size": 131_072}}},
    "zero1": {"model": "small", "world_size": 4, "dtype": "float64",
              "config": {**_COMMON, "zero_optimization": {"stage": 1}}},
    "zero2": {"model": "small", "world_size": 4, "dtype": "float64",
              "config": {**_COMMON, "zero_optimization": {"stage": 2, "reduce_bucket_size": 131_072}}},
    "zero3": {"model": "small", "world_size": 4, "dtype": "float64",
              "config": {**_COMMON, "zero_optimization": {"stage": 3}}},
    # dp 2 x tp 2: each linear layer split over 2 ranks (sequence parallel between them), data
    # parallel (stage 0) over the other axis; clipping by the full model's norm (engine/grad_norm.py).
    "tp": {"model": "small", "world_size": 4, "dtype": "float64",
           "config": {**_COMMON, "parallel": {"tensor": 2, "sequence_parallel": True}}},
    # ZeRO-Infinity's layout: master weights, optimizer states and parameter shards in files
    # (under the system's temporary directory), read ahead and written behind by threads.
    "zero3-offload": {"model": "small", "world_size": 4, "dtype": "float64",
                      "config": {**_COMMON, "zero_optimization": {
                          "stage": 3,
                          "offload_optimizer": {"device": "nvme", "nvme_path": tempfile.gettempdir()},
                          "offload_param": {"device": "nvme", "nvme_path": tempfile.gettempdir()}}}},
}
DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """Everything a rank needs to run the job (picklable: it is sent to spawned ranks)."""

    preset: str
    world_size: int
    steps: int
    config: dict
    model: str = "small"
    dtype: str = "float32"
    seed: int = 0
    show_progress: bool = True
    peak_flops: float | None = None  # one device's peak FLOP/s, for MFU (the CLI measures a CPU's)
    save_dir: str | None = None  # checkpoint directory: written at the end and every save_every steps
    save_every: int = 0
    resume: bool = False  # continue from save_dir's checkpoint (its step, batch and random state)


def make_spec(preset: str, *, world_size: int | None = None, steps: int = 20, config: dict | None = None,
              model: str | None = None, dtype: str | None = None, seed: int = 0, save_dir: str | None = None,
              save_every: int = 0, resume: bool = False) -> TrainSpec:
    """Validate everything before any process starts: preset, sizes, dtype and the config."""
    if preset not in PRESETS:
        raise ValueError(f"--preset {preset!r} is unknown; choose one of {sorted(PRESETS)}")
    dtype = dtype or PRESETS[preset]["dtype"]
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is unknown; choose one of {sorted(DTYPES)}")
    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}")
    p = PRESETS[preset]
    world_size = p["world_size"] if world_size is None else world_size
    if world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {world_size}")
    config = p["config"] if config is None else config
    engine_config = ts.EngineConfig.load(config)
    ts.engine.engine.check_supported(engine_config)
    gpt_config = GPTConfig.preset(model or p["model"])
    if engine_config.parallel.tensor > 1:  # the GPT splits, and the world is dp x tp
        parallelize.check_gpt_split(gpt_config, engine_config.parallel.tensor, world_size)
    engine_config.batch(_dp(engine_config, world_size))  # the batch identity must hold for this world size
    if engine_config.rampup_batch_size is not None:
        raise ts.ConfigError("rampup_batch_size is refused by tinyscale train: it draws every step's batch at "
                             "train_batch_size rows, and its reference run too; a ramp needs a loop that draws "
                             "engine.batch.train_batch_size rows per step (ts.initialize, lesson 12)")
    if save_every < 0 or (save_every or resume) and not save_dir:
        raise ValueError("--save-every and --resume need --save-dir (and --save-every must be positive)")
    if resume:
        _check_resumable(save_dir, seed, steps)
    return TrainSpec(preset, world_size, steps, config, model or p["model"], dtype, seed,
                     save_dir=save_dir, save_every=save_every, resume=resume)


def _dp(config: ts.EngineConfig, world_size: int) -> int:
    """The data-parallel size: the ranks of a tensor-parallel group share their rows."""
    return world_size // config.parallel.tensor


def _check_resumable(save_dir: str, seed: int, steps: int) -> None:
    """The checkpoint's data position must lie inside this run's batches (meta.json only)."""
    from tinyscale.engine.checkpoint_io import live_version, read_meta

    client = read_meta(live_version(save_dir)).get("client_state", {})
    if client.get("seed") != seed:
        raise ValueError(f"--resume: {save_dir} was written by a run with --seed {client.get('seed')}, this one has "
                         f"--seed {seed}: its batches would differ; pass --seed {client.get('seed')}")
    if client.get("data_position", 0) >= steps:
        raise ValueError(f"--resume: {save_dir} is at batch {client.get('data_position')}, and --steps {steps} "
                         "leaves nothing to train: pass a larger --steps")


def build(spec: TrainSpec) -> tuple[GPT, list]:
    """The model and the global batches: identical on every rank and in the reference."""
    cfg = GPTConfig.preset(spec.model)
    model = GPT(cfg, seed=spec.seed, dtype=DTYPES[spec.dtype])
    engine_config = ts.EngineConfig.load(spec.config)
    rows = engine_config.batch(_dp(engine_config, spec.world_size)).train_batch_size
    batches = sample_batches(stdlib_corpus("train").tokens, num_batches=spec.steps, batch_size=rows,
                             seq_len=cfg.max_seq_len, seed=spec.seed)
    return model, batches


def _progress(label: str) -> Progress:
    return Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[stats]}"), TimeElapsedColumn())


def train_rank(spec: TrainSpec) -> dict | None:
    """Run on every rank; rank 0 returns metrics, the ledger, memory and the final parameters."""
    torch.manual_seed(spec.seed)
    model, batches = build(spec)
    num_params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 shards them
    engine = ts.initialize(model, spec.config, peak_flops=spec.peak_flops)
    # The data position: batch i is the same in every run with this seed (sample_batches), so
    # a resumed run continues at the saved index; the checkpoint restores the random state.
    start = engine.load_checkpoint(spec.save_dir)["data_position"] if spec.resume else 0
    rank = ts.dist.rank()
    tokens_per_step = batches[0][0].numel()
    metrics = []
    progress = _progress(f"train {spec.preset} x{spec.world_size}")
    show = spec.show_progress and rank == 0
    if show:
        progress.start()
    task = progress.add_task("train", total=spec.steps, stats="", completed=start)
    try:
        for step, batch in enumerate(batches[start:], start):
            start = time.perf_counter()
            loss = engine.train_batch(batch)
            seconds = time.perf_counter() - start
            row = {"step": step, "loss": loss, "lr": engine.optimizer.param_groups[0]["lr"],
                   "step_time_s": seconds, "tokens": tokens_per_step,
                   "tokens_per_s": tokens_per_step / seconds, "comm_bytes": engine.comm_ledger.bytes(),
                   "mfu_window": engine.last_step["mfu"], "hfu_window": engine.last_step["hfu"]}
            metrics.append(row)
            progress.update(task, advance=1, stats=f"loss {loss:.4f}  {row['tokens_per_s']:,.0f} tok/s  "
                                                   f"{seconds * 1e3:.0f} ms/step")
            if spec.save_dir and (step + 1 == spec.steps or spec.save_every and (step + 1) % spec.save_every == 0):
                engine.save_checkpoint(spec.save_dir, client_state={"data_position": step + 1, "seed": spec.seed})
    finally:
        if show:
            progress.stop()
    state = engine.full_state_dict()  # on every rank: ZeRO-3 all-gathers the parameters for it
    if rank != 0:
        return None
    return {
        "metrics": metrics,
        "ledger": engine.comm_ledger.by_op(),
        "memory": engine.memory_report().as_dict(),
        "state": state,
        "backend": ts.dist.info().backend,
        "num_params": num_params,
        "peak_flops": engine.throughput.peak, "num_devices": engine.throughput.num_devices,
    }


def compare_with_reference(spec: TrainSpec, result: dict, show_progress: bool = True) -> dict:
    """Train fresh models in this process on the same batches; compare losses and parameters.

    Two single-process runs of `ts.reference.train`: the reference takes each global batch
    in one piece (one forward and backward over all its rows: no ranks, no micro-batches,
    nothing in common with the layout under test but the maths), and a control takes it in
    two halves with accumulation. Their only difference is the order in which the same
    numbers are summed, so their distance is the rounding noise floor of this run. Training
    amplifies rounding (in float64, ~1e-16 after one step grows with the steps): a fixed
    tolerance would be wrong for long runs, a noise floor measured on the same run is not.
    Whole-batch passes are also the fast way to train one process: several times faster on
    a CPU than the configured micro-batches of a few rows each.
    """
    model, batches = build(spec)
    control, _ = build(spec)
    rows = batches[0][0].shape[0]
    one_piece = {**spec.config, "train_batch_size": rows, "train_micro_batch_size_per_gpu": rows,
                 "gradient_accumulation_steps": 1}
    # Two halves (or, for an odd batch, one row per micro-batch): another summation order.
    halves = rows // 2 if rows % 2 == 0 else 1
    two_halves = {**one_piece, "train_micro_batch_size_per_gpu": halves, "gradient_accumulation_steps": rows // halves}
    with _progress("reference x1") as progress:
        task = progress.add_task("ref", total=2 * spec.steps, stats="", visible=show_progress)

        def on_step(step: int, loss: float) -> None:
            progress.update(task, advance=1, stats=f"loss {loss:.4f}")

        losses = ts.reference.train(model, batches, one_piece, on_step=on_step)
        ts.reference.train(control, batches, two_halves, on_step=on_step)
    ours = [m["loss"] for m in result["metrics"]]
    losses = losses[result["metrics"][0]["step"]:]  # a resumed run's metrics start at its first step
    return {
        "losses": losses,
        "max_loss_diff": max(abs(a - b) for a, b in zip(ours, losses)),
        "max_param_diff": max_abs_diff(result["state"], model.state_dict()),
        "noise_floor": max_abs_diff(control.state_dict(), model.state_dict()),
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m tinyscale.train` (under torchrun, or alone for one process)."""
    from tinyscale.cli import main as cli_main

    return cli_main(["train", *(argv if argv is not None else __import__("sys").argv[1:])])


if __name__ == "__main__":
    raise SystemExit(main())
