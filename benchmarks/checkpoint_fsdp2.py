"""Checkpoint save and load against torch's FSDP2 + DCP, and what each rank writes per layout.

Issue 26's benchmark, beside `benchmarks/checkpoint.py` (file sizes per ZeRO stage, fsync's price).
On N CPU ranks over gloo (tinyscale's launcher), one run:

1. The same GPT (float32, untied: torch's state_dict names a tied table twice) and AdamW, trained
   one step, two ways: tinyscale at ZeRO 3 over N ranks (`engine.save_checkpoint` /
   `load_checkpoint`: DCP pieces from the placements, checksums, fsync, an atomic pointer), and
   torch's recipe (`fully_shard` on each block and the root, `get_state_dict`, `dcp.save` /
   `dcp.load` + `set_state_dict`; DCP's FileSystemWriter fsyncs too, but keeps no versions and
   checks no checksums). Saves and loads alternate round-robin (`tinyscale.bench`), each timed as
   the slowest rank's; the bytes are each rank's DCP file. Ratios ours / torch's.
2. Each rank's file bytes in six layouts of the same model: ZeRO 0-3 over N ranks, tp N, pp N.

    .venv/bin/python benchmarks/checkpoint_fsdp2.py [--world-size 2] [--model small] [--repeats 5]
        [--dir runs/checkpoint_fsdp2] [--json PATH]

Writes only under --dir (removed afterwards unless --keep).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from rich.console import Console
from rich.table import Table
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import tinyscale as ts
from tinyscale.bench import add_json_argument, round_robin, slowest, summary, write_json
from tinyscale.data import sample_batches, stdlib_corpus
from tinyscale.engine import checkpoint_io
from tinyscale.models import GPT, GPTConfig

ROWS_PER_RANK = 2
LAYOUTS = {"zero 0": {"stage": 0}, "zero 1": {"stage": 1}, "zero 2": {"stage": 2}, "zero 3": {"stage": 3},
           "tp": {"tensor": True}, "pp": {"pipeline": True}}


def _model(name: str) -> GPT:
    cfg = dataclasses.replace(GPTConfig.preset(name), tie_embeddings=False)
    return GPT(cfg, seed=0, dtype=torch.float32)


def _config(world: int, stage: int = 0, tensor: bool = False, pipeline: bool = False) -> dict:
    dp = 1 if tensor or pipeline else world
    return {"train_batch_size": ROWS_PER_RANK * world, "train_micro_batch_size_per_gpu": ROWS_PER_RANK,
            "gradient_accumulation_steps": world // dp,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage},
            "parallel": {"tensor": world if tensor else 1, "pipeline": world if pipeline else 1}}


def _rank_file(version: Path) -> int:
    return (version / f"__{dist.get_rank()}_0.distcp").stat().st_size


def run_rank(model_name: str, repeats: int, directory: str) -> dict:
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")  # torch's own: overwrite is meant
    world, root = dist.get_world_size(), Path(directory)
    batch = sample_batches(stdlib_corpus("train").tokens, num_batches=1, batch_size=ROWS_PER_RANK * world,
                           seq_len=GPTConfig.preset(model_name).max_seq_len, seed=0)[0]
    engine = ts.initialize(_model(model_name), _config(world, stage=3))
    engine.train_batch(batch)

    model = _model(model_name)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ids, targets = batch
    mine = slice(dist.get_rank() * ROWS_PER_RANK, (dist.get_rank() + 1) * ROWS_PER_RANK)
    model(ids[mine], targets[mine]).backward()
    opt.step()
    opt.zero_grad()

    ours, theirs = root / "ours", str(root / "fsdp2")

    def fsdp2_save(_):
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=theirs)

    def fsdp2_load(_):
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=theirs)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

    saves = round_robin({"ours": lambda _: engine.save_checkpoint(ours), "fsdp2": fsdp2_save}, repeats,
                        before=dist.barrier)
    loads = round_robin({"ours": lambda _: engine.load_checkpoint(ours), "fsdp2": fsdp2_load}, repeats,
                        before=dist.barrier)
    out = {"save": saves, "load": loads,
           "bytes": {"ours": _rank_file(checkpoint_io.live_version(ours)), "fsdp2": _rank_file(Path(theirs))},
           "layouts": {}}
    for name, layout in LAYOUTS.items():
        engine = ts.initialize(_model(model_name), _config(world, **layout))
        engine.train_batch(batch)
        where = root / "layouts" / name.replace(" ", "")
        engine.save_checkpoint(where)
        out["layouts"][name] = _rank_file(checkpoint_io.live_version(where))
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", default="small", choices=["tiny", "small"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="runs/checkpoint_fsdp2", help="where to write (a real disk, not tmpfs)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints under --dir")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    try:
        per_rank = ts.dist.launch(run_rank, args.world_size, args.model, args.repeats, str(root), timeout_s=1800)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    params = sum(p.numel() for p in _model(args.model).parameters())
    times = {op: {v: summary(slowest([r[op][v] for r in per_rank])) for v in ("ours", "fsdp2")}
             for op in ("save", "load")}
    table = Table(title=f"{args.model} GPT ({params:,} params, float32, AdamW), {args.world_size} CPU ranks (gloo), "
                        f"median (fastest .. slowest) of {args.repeats}")
    for column in ("", "tinyscale ZeRO 3", "torch FSDP2 + DCP", "ours / torch"):
        table.add_column(column, justify="right")
    for op in ("save", "load"):
        t = times[op]
        table.add_row(f"{op}, ms", t["ours"].ms(), t["fsdp2"].ms(), f"{t['ours'].median / t['fsdp2'].median:.2f}")
    for r, result in enumerate(per_rank):
        b = result["bytes"]
        table.add_row(f"rank {r} file, bytes", f"{b['ours']:,}", f"{b['fsdp2']:,}", f"{b['ours'] / b['fsdp2']:.3f}")
    sizes = Table(title=f"each rank's DCP file per layout, bytes (12 x params = {12 * params:,})")
    sizes.add_column("layout")
    for r in range(args.world_size):
        sizes.add_column(f"rank {r}", justify="right")
    for name in LAYOUTS:
        label = name if name.startswith("zero") else f"{name} {args.world_size}"
        sizes.add_row(label, *[f"{r['layouts'][name]:,}" for r in per_rank])
    console = Console()
    console.print(table)
    console.print(sizes)
    ratios = {"ckpt_save_vs_fsdp2": times["save"]["ours"].median / times["save"]["fsdp2"].median,
              "ckpt_load_vs_fsdp2": times["load"]["ours"].median / times["load"]["fsdp2"].median,
              "ckpt_bytes_vs_fsdp2": sum(r["bytes"]["ours"] for r in per_rank)
              / sum(r["bytes"]["fsdp2"] for r in per_rank)}
    details = {"params": params, "world_size": args.world_size,
               "times_s": {op: {v: dataclasses.asdict(s) for v, s in t.items()} for op, t in times.items()},
               "bytes_per_rank": [r["bytes"] for r in per_rank],
               "layout_bytes_per_rank": {name: [r["layouts"][name] for r in per_rank] for name in LAYOUTS}}
    write_json(args.json, ratios, **details)
    return {"ratios": ratios, **details}


if __name__ == "__main__":
    main()
