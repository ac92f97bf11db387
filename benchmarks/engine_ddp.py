"""The engine's data parallelism (ZeRO 0: BucketedDDP inside) against torch's DistributedDataParallel, same run.

    python benchmarks/engine_ddp.py [--world-sizes 2 4] [--steps 20] [--model small] [--json PATH]

On the same rank processes and the same batches, steps interleaved round robin in a shuffled
order each round (tinyscale.bench, `shuffle=0`: each variant follows each other about equally
often; 2 warm-up rounds dropped, the slowest rank's step, median and spread):

    engine                  ts.initialize(...).train_batch: ZeRO 0's buckets in torch DDP's
                            layout (a first bucket of 1 MiB, the rest of reduce_bucket_size)
    engine, one bucket      the same with every gradient in one bucket (the engine's layout
                            before it took torch's; reduce_bucket_size's default is 5e8 elements)
    torch DDP               forward, backward, AdamW step on this rank's rows

The engine's step adds to plain DDP what a real trainer does: micro-batching, an all-reduce
of the loss for reporting, gradient clipping and the LR schedule. The table shows each
median with its spread, the ratio to torch DDP with a 95% bootstrap interval
(`tinyscale.bench.ratio_interval`), and the bytes each all-reduces per step.
`benchmarks/ddp.py` compares the data-parallel wrappers alone; `benchmarks/deepspeed.py
--stages 0` the engine against DeepSpeed's ZeRO 0 (one all-reduce after backward).
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import tinyscale as ts
from tinyscale.bench import add_json_argument, ratio_interval, round_robin, slowest, summary, write_json
from tinyscale.data import local_micro_batches, sample_batches, stdlib_corpus
from tinyscale.engine import engine as engine_module
from tinyscale.models import GPT, GPTConfig


def _bench_rank(model_name: str, steps: int, micro: int) -> dict:
    cfg = GPTConfig.preset(model_name)
    world, rank = dist.get_world_size(), dist.get_rank()
    config = {"train_micro_batch_size_per_gpu": micro, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    batches = sample_batches(stdlib_corpus("train").tokens, num_batches=steps + 2, batch_size=micro * world,
                             seq_len=cfg.max_seq_len, seed=0)
    engine = ts.initialize(GPT(cfg, seed=0), config)
    with mock.patch.object(engine_module, "TORCH_FIRST_BUCKET_MB", float("inf")):  # first cap = reduce_bucket_size
        one_bucket = ts.initialize(GPT(cfg, seed=0), config)
    model = GPT(cfg, seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def torch_step(i):
        (local,) = local_micro_batches(batches[i], dp_rank=rank, dp_size=world, micro_batch_size=micro)
        ddp(*local).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = round_robin({"engine": lambda i: engine.train_batch(batches[i]),
                         "engine, one bucket": lambda i: one_bucket.train_batch(batches[i]),
                         "torch DDP": torch_step}, steps, warmup=2, before=dist.barrier, shuffle=0)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buckets = {"engine": len(engine.ddp.buckets), "engine, one bucket": len(one_bucket.ddp.buckets),
               "torch DDP": ddp._get_ddp_logging_data().get("num_buckets_reduced")}  # (after its rebuild)
    return {"times": times, "buckets": buckets,
            "bytes": {"engine": engine.comm_ledger.bytes("all_reduce") / len(batches),
                      "engine, one bucket": one_bucket.comm_ledger.bytes("all_reduce") / len(batches),
                      "torch DDP": grad_bytes}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=20, help="timed rounds (each variant one step a round)")
    parser.add_argument("--model", default="small", choices=["tiny", "small"])
    parser.add_argument("--micro", type=int, default=4, help="rows per rank per step")
    add_json_argument(parser)
    args = parser.parse_args()
    console = Console()
    ratios, intervals = {}, {}
    for world in args.world_sizes:
        with console.status(f"{world} ranks..."):
            per_rank = ts.dist.launch(_bench_rank, world, args.model, args.steps, args.micro, timeout_s=1800)
        steps = {name: slowest([r["times"][name] for r in per_rank]) for name in per_rank[0]["times"]}
        base = summary(steps["torch DDP"]).median
        table = Table(title=f"engine (ZeRO 0) vs torch DDP, {world} ranks ({ts.dist.resolve_backend('auto', world)}): "
                            f"{args.model} GPT, {args.micro} rows/rank, median of {args.steps} steps")
        for col in ("variant", "buckets", "ms/step (min .. max)", "vs torch DDP (95% interval)", "all-reduce bytes/step"):
            table.add_column(col, justify="right")
        for name, t in steps.items():
            low, high = ratio_interval(t, steps["torch DDP"])
            table.add_row(name, str(per_rank[0]["buckets"][name]), summary(t).ms(),
                          f"{summary(t).median / base:.3f}x ({low:.3f} .. {high:.3f})",
                          f"{per_rank[0]['bytes'][name]:,.0f}")
        console.print(table)
        key = f"engine_ddp_vs_torch_{world}"
        ratios[key] = summary(steps["engine"]).median / base
        intervals[key] = ratio_interval(steps["engine"], steps["torch DDP"])
        low, high = ratio_interval(steps["engine"], steps["engine, one bucket"])
        layout = summary(steps["engine"]).median / summary(steps["engine, one bucket"]).median
        console.print(f"engine, torch's layout / one bucket: {layout:.3f}x (95% interval {low:.3f} .. {high:.3f})\n")
    console.print(f"machine: {torch.get_num_threads()} threads here, torch {torch.__version__}, "
                  f"{'CUDA ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU only'}")
    write_json(args.json, ratios, model=args.model, steps=args.steps,
               intervals={k: [round(v, 4) for v in iv] for k, iv in intervals.items()})


if __name__ == "__main__":
    main()
