"""Matmul throughput swept over dtypes and shapes on this device, beside the published peaks.

Answers OPT-6 (lesson 06, "What makes a matmul fast"): the same square matmul in each
dtype, at sizes that are multiples of 64 and at odd sizes just beside them, timed as
`tinyscale.mfu.measured_peak` times one (best of a few repeats: on a shared machine the
slower repeats measure the neighbours), as FLOP/s = 2 m n k / seconds. On CUDA the fp32
rows run twice, with TF32 off and on. The vendor peaks come from `tinyscale.mfu`'s table.
Each row also carries what can be checked on any device (`check_matmul`): the FLOPs torch's
FlopCounterMode counts (2 m n k, aligned or odd: an odd size is slower, not more work) and
the error against float64 on the same rounded inputs, over its rounding bound.

    .venv/bin/python benchmarks/matmul_sweep.py [--device cuda] [--sizes 512 1024 2048]

Tests: `pytest -k matmul_sweep`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from tinyscale.mfu.peak import PEAK_TFLOPS, device_key
from tinyscale.bench import add_json_argument, write_json


def matmul_flops(m: int, n: int, k: int) -> int:
    """An (m x k) @ (k x n) product: m n k multiply-adds, 2 m n k FLOPs."""
    return 2 * m * n * k


def time_matmul(n: int, dtype: torch.dtype, device: torch.device, *, repeats: int = 5,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """Best FLOP/s of an n x n x n matmul over `repeats` timed calls (after one warm-up)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    best = 0.0
    for _ in range(repeats):
        sync()
        start = clock()
        torch.mm(a, b)
        sync()
        best = max(best, matmul_flops(n, n, n) / max(clock() - start, 1e-12))
    return best


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p for p significand bits (float64 2^-53, float32 2^-24, bfloat16 2^-8)."""
    return torch.finfo(dtype).eps / 2


def check_matmul(n: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict:
    """FLOPs counted by torch for an n x n x n matmul in `dtype`, and its largest error against
    float64 on the same (rounded) inputs, as a fraction of a rounding bound. For float32 and
    float64, the classical |fl(AB) - AB| <= gamma_n |A||B|, gamma_n = n u / (1 - n u) (Higham,
    Thm 3.5), u the dtype's unit roundoff. For 16-bit dtypes that bound is vacuous from n = 256
    (bf16: n u = 1); their kernels (oneDNN here, tensor cores on a GPU) accumulate in float32
    and round the result once, so the bound is u16 |AB| + (1 + u16) gamma_n(u32) |A||B|. A
    kernel that accumulated in less precision, or dropped a term, exceeds it."""
    from torch.utils.flop_counter import FlopCounterMode

    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    with FlopCounterMode(display=False) as counter:
        c = torch.mm(a, b)
    a64, b64 = a.double(), b.double()
    exact = a64 @ b64
    err = (c.double() - exact).abs()
    u = unit_roundoff(dtype)
    acc = min(u, unit_roundoff(torch.float32))  # the accumulator's roundoff
    gamma = n * acc / (1 - n * acc)
    bound = gamma * (a64.abs() @ b64.abs())
    if acc < u:  # one rounding of the float32 sum to the 16-bit output
        bound = u * exact.abs() + (1 + u) * bound
    return {"counted_flops": counter.get_total_flops(), "max_abs_err": err.max().item(),
            "err_over_bound": (err / bound).max().item()}


def sweep(sizes: list[int], dtypes: list[str], device: torch.device, repeats: int = 5) -> list[dict]:
    """One row per (dtype, size): the aligned size and the odd sizes n - 1 and n + 1."""
    rows = []
    for name in dtypes:
        tf32 = name == "tf32"
        dtype = torch.float32 if tf32 else getattr(torch, name)
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = tf32
        for n in sizes:
            for size in (n - 1, n, n + 1):
                rows.append({"dtype": name, "n": size, "aligned": size % 64 == 0,
                             "flops": time_matmul(size, dtype, device, repeats=repeats),
                             **check_matmul(size, dtype, device)})
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    add_json_argument(parser)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtypes = ["float64", "float32", "bfloat16"] + (["tf32", "float16"] if device.type == "cuda" else [])
    rows = sweep(args.sizes, dtypes, device, args.repeats)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    key = device_key(name) if device.type == "cuda" else None
    print(f"device: {name}; published dense peaks (TFLOP/s): {PEAK_TFLOPS.get(key, 'none for a CPU')}")
    print(f"{'dtype':9s} {'n':>6s} {'aligned':>8s} {'TFLOP/s':>9s} {'counted FLOPs':>14s} {'max err':>9s} {'err/bound':>9s}")
    for r in rows:
        print(f"{r['dtype']:9s} {r['n']:6d} {str(r['aligned']):>8s} {r['flops'] / 1e12:9.4f} "
              f"{r['counted_flops']:14,d} {r['max_abs_err']:9.2e} {r['err_over_bound']:9.2e}")
    write_json(args.json, {}, device=name, rows=rows)
    return rows


if __name__ == "__main__":
    main()
