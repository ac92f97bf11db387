"""What a checkpoint weighs and what making it crash-safe costs: file sizes per ZeRO stage, fsync's price.

Answers DS-33 (lesson 03, "What a training checkpoint must hold"): a GPT in float32 with
AdamW, trained one step on N CPU ranks at ZeRO stages 0-3, then saved with
`engine.save_checkpoint` several times. Per stage: the bytes of each file of the live
version (DCP's: rank r's shard file ``__r_0.distcp``, ``.metadata``; and meta.json), and the
median seconds of a save (rank 0's wall time: planning, serialising, writing its pieces,
committing) with fsync and with `os.fsync` replaced by a no-op (what a writer that does not
care about power cuts would pay). The checkpoint holds ~12Ψ bytes at every stage (4Ψ of
parameters, 8Ψ of AdamW's two moments), split over the rank files by who owns what
(`engine/dcp_checkpoint.py`): at stage 0 rank 0 writes everything, at stages 1-3 each rank
its ZeRO shard, ~12Ψ/N.

    .venv/bin/python benchmarks/checkpoint.py [--world-size 2] [--model small] [--saves 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import tinyscale as ts
from tinyscale.bench import add_json_argument, write_json
from tinyscale.data import sample_batches, stdlib_corpus
from tinyscale.engine import checkpoint_io
from tinyscale.models import GPT, GPTConfig

ROWS_PER_RANK = 4


def _save_seconds(engine, path: Path, fsync: bool) -> float:
    real = os.fsync
    if not fsync:
        os.fsync = lambda fd: None  # noqa: E731 - the unsafe writer, for comparison only
    try:
        start = time.perf_counter()
        engine.save_checkpoint(path)
        return time.perf_counter() - start
    finally:
        os.fsync = real


def run_rank(model_name: str, saves: int, directory: str) -> list[dict] | None:
    cfg = GPTConfig.preset(model_name)
    world = ts.dist.world_size()
    rows = []
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = GPT(cfg, seed=0, dtype=torch.float32)
        num_params = sum(p.numel() for p in model.parameters())
        engine = ts.initialize(model, {"train_micro_batch_size_per_gpu": ROWS_PER_RANK,
                                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                       "zero_optimization": {"stage": stage}})
        batch = sample_batches(stdlib_corpus("train").tokens, num_batches=1, batch_size=ROWS_PER_RANK * world,
                               seq_len=cfg.max_seq_len, seed=0)[0]
        engine.train_batch(batch)  # the optimizer's states exist from the first step
        path = Path(directory) / f"stage{stage}"
        times = {True: [], False: []}
        for i in range(2 * saves):  # alternate, so that drift in the machine's load hits both alike
            times[i % 2 == 0].append(_save_seconds(engine, path, fsync=i % 2 == 0))
        if ts.dist.rank() == 0:
            live = checkpoint_io.live_version(path)
            rows.append({"stage": stage, "params": num_params,
                         "files": {f.name: f.stat().st_size for f in sorted(live.iterdir())},
                         "save_fsync_s": statistics.median(times[True]),
                         "save_no_fsync_s": statistics.median(times[False])})
    return rows if ts.dist.rank() == 0 else None


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", default="small", choices=["tiny", "small"])
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (a real disk, not tmpfs)")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        rows = ts.dist.launch(run_rank, args.world_size, args.model, args.saves, directory, timeout_s=1800)[0]
    print(f"{args.model} GPT ({rows[0]['params']:,} params, float32, AdamW), {args.world_size} ranks, "
          f"median of {args.saves} saves each")
    names = list(rows[0]["files"])
    print(f"{'stage':>5} " + " ".join(f"{n:>14}" for n in names) + f" {'save, fsync':>12} {'no fsync':>9}")
    for r in rows:
        print(f"{r['stage']:5d} " + " ".join(f"{r['files'].get(n, 0):14,d}" for n in names)
              + f" {r['save_fsync_s'] * 1e3:9.1f} ms {r['save_no_fsync_s'] * 1e3:6.1f} ms")
    write_json(args.json, {}, rows=rows)
    return rows


if __name__ == "__main__":
    main()
