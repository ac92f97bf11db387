"""Restart a crashed run from its latest complete checkpoint: `tinyscale train --resume-on-failure N`.

    result, restarts = train_with_recovery(spec, max_restarts=3)
    tinyscale elastic --global-batch 1024 --micro-batches 1,2,4 [--model-parallel 16] [--min-gpus 512]

A rank that dies (an exception, a killed process, a hung collective caught by the launcher's
timeout) stops the whole launch: `dist.launch` re-raises it and ends the other ranks. Then, at
most `max_restarts` times, the ranks are launched again with `resume=True`: each loads the latest
*complete* checkpoint of `save_dir` (checkpoints are written under a temporary name and made live
by a rename, so a crash during a write leaves the previous one live) and continues from its data
position, with its random state, exactly as an uninterrupted run would (the engine's resume is
bit for bit: `pytest -k resume_exact`). Only the engine's public `save_checkpoint` /
`load_checkpoint` (through `train_rank`) are used. Without a checkpoint to resume from, or after
`max_restarts` restarts, the error is raised. Under torchrun, use its own `--max-restarts`.
A restart here uses the same world size; `elastic_world_sizes` lists the others a restart could
use without changing the global batch (DeepSpeed's `elasticity` config computes the same).
Lesson: lessons/12-engine.md ("Faults and recovery"). Tests: `pytest -k "resume_on_failure or elastic"`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


def has_checkpoint(save_dir: str | None) -> bool:
    """Whether `save_dir` holds anything to resume from (what is in it is `load_checkpoint`'s to judge)."""
    from pathlib import Path

    return bool(save_dir) and Path(save_dir).is_dir() and any(Path(save_dir).iterdir())


def train_with_recovery(spec, *, max_restarts: int, rank_fn: Callable | None = None, timeout_s: float = 3600,
                        log: Callable[[str], None] = print):
    """Launch `rank_fn` (default `train.train_rank`) on spec.world_size ranks; on a failure,
    relaunch from the latest complete checkpoint, at most `max_restarts` times. Returns (rank 0's
    result of the last launch, how many restarts it took)."""
    from tinyscale import dist
    from tinyscale.train import train_rank

    if max_restarts < 0:
        raise ValueError(f"--resume-on-failure {max_restarts}: give a count >= 0")
    if max_restarts and not (spec.save_dir and spec.save_every):
        raise ValueError("--resume-on-failure needs --save-dir and --save-every: a restart resumes from the "
                         "latest checkpoint, so the run must write them as it goes")
    rank_fn = rank_fn or train_rank
    restarts = 0
    # --8<-- [start:restart-loop]
    while True:
        try:
            return dist.launch(rank_fn, spec.world_size, spec, timeout_s=timeout_s)[0], restarts
        except Exception as exc:  # noqa: BLE001 - any rank's failure; relaunch or re-raise
            if restarts >= max_restarts or not has_checkpoint(spec.save_dir):
                raise
            restarts += 1
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log(f"run failed ({first_line}); restart {restarts} of {max_restarts} from {spec.save_dir}")
            spec = dataclasses.replace(spec, resume=True)
    # --8<-- [end:restart-loop]


# --8<-- [start:elastic]
def elastic_world_sizes(global_batch: int, micro_batches: list[int], *, min_gpus: int = 1,
                        max_gpus: int | None = None, model_parallel: int = 1) -> list[tuple[int, int, int]]:
    """The GPU counts a job can restart on and keep its global batch: (gpus, micro-batch,
    accumulation steps) with gpus = dp x model_parallel in [min_gpus, max_gpus] and
    global_batch = dp x micro-batch x accumulation for one of `micro_batches` (the largest that
    fits is taken, as DeepSpeed's elasticity does). model_parallel: tp x pp x cp, fixed."""
    if global_batch < 1 or model_parallel < 1 or not micro_batches or min(micro_batches) < 1:
        raise ValueError(f"global_batch={global_batch}, micro_batches={micro_batches}, model_parallel="
                         f"{model_parallel}: give positive ints (and at least one micro-batch size)")
    max_gpus = max_gpus or global_batch * model_parallel
    out = []
    for dp in range(1, global_batch + 1):
        gpus = dp * model_parallel
        if global_batch % dp or not min_gpus <= gpus <= max_gpus:
            continue
        fitting = [b for b in micro_batches if (global_batch // dp) % b == 0]
        if fitting:
            b = max(fitting)
            out.append((gpus, b, global_batch // (dp * b)))
    return out
# --8<-- [end:elastic]


def add_parser(sub) -> None:
    p = sub.add_parser("elastic", help="the GPU counts a restart may use with the global batch unchanged")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per step, kept fixed")
    p.add_argument("--micro-batches", default="1", help="micro-batch sizes allowed, comma-separated (default 1)")
    p.add_argument("--model-parallel", type=int, default=1, help="GPUs per model replica: tp x pp x cp")
    p.add_argument("--min-gpus", type=int, default=1)
    p.add_argument("--max-gpus", type=int, default=None)


def cmd_elastic(args, console) -> int:
    from rich.table import Table

    try:
        micro = [int(x) for x in args.micro_batches.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--micro-batches {args.micro_batches!r}: give sizes like 1,2,4") from None
    rows = elastic_world_sizes(args.global_batch, micro, min_gpus=args.min_gpus, max_gpus=args.max_gpus,
                               model_parallel=args.model_parallel)
    table = Table(title=f"global batch {args.global_batch}: {len(rows)} GPU counts keep it")
    for col in ("GPUs", "data parallel", "micro-batch", "accumulation"):
        table.add_column(col, justify="right")
    for gpus, b, acc in rows:
        table.add_row(str(gpus), str(gpus // args.model_parallel), str(b), str(acc))
    console.print(table)
    return 0 if rows else 1
