"""MFU of the GPT's single-device training step, on whatever device this runs on.

    python benchmarks/mfu.py                                      # CPU, float32, small GPT
    python benchmarks/mfu.py --device cuda --dtype bfloat16       # one GPU, bf16 autocast
    python benchmarks/mfu.py --model small --rows 64 --steps 30 --recompute full

Trains the GPT (AdamW, `--rows` sequences of max_seq_len tokens per step) for `--steps`
steps under the StepProfiler and a WindowedMFU over every step after the warm-up, and prints:
the device, the peak used (the vendor's dense table value on a known GPU, the measured matmul
peak otherwise, both when both exist), tokens/s, MFU and HFU, and the profiler's table.
float32 on a GPU runs its matmuls in TF32 (allow_tf32), so its table peak is the TF32 one.
Lesson: lessons/06-mfu.md (where the GPU measurement is reported, once it has been run).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from rich.console import Console

from tinyscale.bench import add_json_argument, write_json
from tinyscale.checkpointing import apply_policy
from tinyscale.data import synthetic_token_batches
from tinyscale.mfu import (
    StepProfiler,
    WindowedMFU,
    device_key,
    hardware_flops_per_token,
    measured_peak,
    model_flops_per_token,
    peak_flops,
    summary,
    table,
)
from tinyscale.models import GPT, GPTConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="autocast dtype of the matmuls")
    parser.add_argument("--model", default="small")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--recompute", default="none", choices=["none", "full"], help="full: every block")
    add_json_argument(parser)
    args = parser.parse_args()
    console = Console()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # what fp32 training on a GPU does in practice
    cfg = GPTConfig.preset(args.model)
    T = cfg.max_seq_len

    table_peak = None
    if device.type == "cuda" and device_key(torch.cuda.get_device_name(device)) is not None:
        table_peak = peak_flops(device, "tf32" if dtype == torch.float32 else dtype)
    measured = measured_peak(device, dtype, max_seconds=2.0)
    peak = table_peak or measured
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    console.print(f"device: {name} ({torch.get_num_threads()} threads)" if device.type == "cpu" else f"device: {name}")
    console.print(f"peak: measured {measured / 1e12:.3f} TFLOP/s ({args.dtype} matmul)"
                  + (f", table {table_peak / 1e12:.1f} TFLOP/s (dense; used for MFU)" if table_peak else " (used for MFU)"))

    model = GPT(cfg, seed=0, device=device)
    apply_policy(model, args.recompute)  # "full": every block recomputed whole (tinyscale.checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = synthetic_token_batches(num_batches=args.steps, batch_size=args.rows, seq_len=T, seed=0)
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext())
    flops = model_flops_per_token(cfg, T)
    hw = hardware_flops_per_token(cfg, T, recompute=args.recompute)
    tracker = WindowedMFU(flops, peak, window=args.steps, warmup_steps=args.warmup, hardware_flops_per_token=hw)
    prof = StepProfiler(device=device)
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with prof.step(tokens=x.numel()):
            with prof.phase("forward"), autocast:
                loss = model(x, y)
            with prof.phase("backward"):
                loss.backward()
            with prof.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        tracker.update(x.numel(), prof.records[-1].breakdown.step)
    s = summary(prof.records, skip=args.warmup)
    console.print(table(prof.records, skip=args.warmup, title=f"{args.model} GPT, {args.rows} x {T} tokens, "
                                                              f"{args.dtype}, recompute={args.recompute}"))
    console.print(f"tokens/s {s['tokens_per_s']:,.0f} | model FLOPs/token {flops:,.0f} | "
                  f"MFU {100 * tracker.mfu:.2g}% | HFU {100 * tracker.hfu:.2g}%")  # 2 digits: a GPU's small-model MFU is 0.03%
    write_json(args.json, {}, device=name, dtype=args.dtype, model=args.model, tokens_per_s=s["tokens_per_s"],
               mfu=tracker.mfu, hfu=tracker.hfu)


if __name__ == "__main__":
    main()
