"""tinyscale's Triton kernels against PyTorch eager (and flash attention against SDPA) on a GPU.

Lesson 11 ("Kernels"). Each kernel and its eager counterpart are timed with CUDA events
(median of `--repeats` calls after warm-up); the table gives the time, the achieved
bandwidth (the fused kernel's minimal bytes / time, the same bytes for both columns, so the
ratio is the speed-up) or FLOP rate, and the fraction of the device's datasheet peak. The
byte and FLOP counts are `notebooks/kernels_traffic.py`'s, from the shapes.

    .venv/bin/python benchmarks/kernels.py                 # needs a CUDA GPU; says so and exits 0 without
    .venv/bin/python benchmarks/kernels.py --smoke         # tiny shapes on the CPU under Triton's
                                                           # interpreter: checks the script runs, times nothing

Measured once, on one H100 SXM (torch 2.11.0+cu130, Triton 3.6.0, 2026-11-26): the table is in
lessons/11-kernels.md ("Measured on an H100"). No other GPU has run it. The LN+dropout+residual
rows (DS-32) were added later and ran on the same kind of H100 on the same day (lesson 11, DS-32).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv and os.environ.get("TRITON_INTERPRET") is None:
    os.environ["TRITON_INTERPRET"] = "1"  # before tinyscale imports Triton

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from tinyscale.kernels import (HAS_TRITON, flash_attention, fused_adamw_, fused_dropout_residual_layer_norm,
                               fused_linear_cross_entropy, quantize_int8, quantize_reference, rms_norm,
                               rms_norm_reference)
from tinyscale.mfu.peak import PEAK_TFLOPS, device_key

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "notebooks"))
import kernels_traffic as kt  # noqa: E402 - the byte and FLOP counts the notebook uses
from tinyscale.bench import add_json_argument, write_json
from tinyscale.kernels.fused_norm import backward_programs  # noqa: E402

# HBM bandwidth, TB/s, from the same NVIDIA datasheets as tinyscale.mfu's peak table.
PEAK_HBM_TBS = {"H100 SXM": 3.35, "H100 PCIe": 2.0, "H100 NVL": 3.9, "H200 SXM": 4.8, "H200 NVL": 4.8,
                "A100": 2.039}


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls, after 3 warm-up calls (compilation, caches)."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return sorted(s.elapsed_time(e) for s, e in events)[repeats // 2] / 1e3


def cases(device: torch.device, dtype: torch.dtype, smoke: bool) -> list[dict]:
    """Each case: name, the fused call, the eager call(s), and its bytes and FLOPs (from the shapes)."""
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dt=dtype, grad=False):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dt).requires_grad_(grad)

    R, N = (8, 24) if smoke else (8192, 4096)
    n = 1000 if smoke else 256 * 2**20
    B, H, K, T, D = (1, 4, 2, 32, 16) if smoke else (4, 32, 8, 4096, 128)
    Nc, C, V, chunk = (32, 16, 100, 8) if smoke else (8192, 4096, 128256, 1024)
    out = []

    x, w = randn(R, N), randn(N)
    out.append(dict(name="RMSNorm fwd", fused=lambda: rms_norm(x, w), eager={"eager": lambda: rms_norm_reference(x, w, 1e-6)},
                    bytes=kt.fused_traffic("rmsnorm", e=x.element_size(), R=R, N=N)))

    # DS-32: h = residual + dropout(x), y = LayerNorm(h); the eager mask is F.dropout's (Philox), ours the counter's
    Bn = 1 if smoke else 8  # R rows as (B, T) = (8, 1024): a batch of sequences
    x3, r3 = randn(Bn, R // Bn, N, grad=True), randn(Bn, R // Bn, N, grad=True)
    wl, bl = randn(N, grad=True), randn(N, grad=True)

    def eager_norm():
        h = r3 + F.dropout(x3, 0.1, training=True)
        return F.layer_norm(h, (N,), wl, bl), h

    def fwd_bwd(fn):
        y, h = fn()
        return torch.autograd.grad((y, h), (x3, r3, wl, bl), (y, h))  # (y, h) as the incoming gradients: any will do

    fused_norm = lambda: fused_dropout_residual_layer_norm(x3, r3, wl, bl, p=0.1, key=1234)  # noqa: E731
    norm_bytes = kt.fused_traffic("fused_norm", e=x3.element_size(), R=R, N=N)
    out.append(dict(name="LN+dropout+residual fwd", fused=fused_norm, eager={"eager": eager_norm}, bytes=norm_bytes))
    out.append(dict(name="LN+dropout+residual fwd+bwd", fused=lambda: fwd_bwd(fused_norm),
                    eager={"eager": lambda: fwd_bwd(eager_norm)},
                    bytes=norm_bytes + kt.fused_traffic("fused_norm_backward", e=x3.element_size(), R=R, N=N,
                                                                     P=backward_programs(R, x3.device))))

    p, grad_ = randn(n, dt=torch.float32), randn(n, dt=torch.float32)
    m, v = torch.zeros_like(p), torch.zeros_like(p)  # AdamW's moments (v >= 0: it is square-rooted)
    param = torch.nn.Parameter(p.clone())
    param.grad = grad_.clone()
    eager_adamw = {"torch AdamW foreach": torch.optim.AdamW([param], lr=1e-4, foreach=True).step}
    if device.type == "cuda":
        fused_param = torch.nn.Parameter(p.clone())
        fused_param.grad = grad_.clone()
        eager_adamw["torch AdamW fused=True"] = torch.optim.AdamW([fused_param], lr=1e-4, fused=True).step
    out.append(dict(name="AdamW step (fp32)", eager=eager_adamw, bytes=kt.fused_traffic("adamw", n=n),
                    fused=lambda: fused_adamw_(p, grad_, m, v, lr=1e-4, weight_decay=0.01, step=1)))

    xq = randn(n, dt=torch.float32)
    out.append(dict(name="quantize int8 (fp32 in)", fused=lambda: quantize_int8(xq, 256),
                    eager={"eager": lambda: quantize_reference(xq, 256)},
                    bytes=kt.fused_traffic("quantize", n=n, block=256)))

    q, k, vv = randn(B, H, T, D, grad=True), randn(B, K, T, D, grad=True), randn(B, K, T, D, grad=True)
    k_rep, v_rep = k.repeat_interleave(H // K, 1).detach(), vv.repeat_interleave(H // K, 1).detach()
    shape = dict(B=B, H=H, K=K, T=T, D=D)
    out.append(dict(name="attention fwd (causal, GQA)", fused=lambda: flash_attention(q, k, vv, causal=True),
                    eager={"SDPA": lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)},
                    flops=kt.flops("attention", **shape)))

    def fa_fwd_bwd():
        o, _ = flash_attention(q, k, vv, causal=True)
        torch.autograd.grad(o.sum(), (q, k, vv))

    def sdpa_fwd_bwd():
        kr, vr = k.repeat_interleave(H // K, 1), vv.repeat_interleave(H // K, 1)
        torch.autograd.grad(F.scaled_dot_product_attention(q, kr, vr, is_causal=True).sum(), (q, k, vv))

    # backward: 2.5x the forward's matmul work (dV, dP, dQ, dK, and S recomputed)
    out.append(dict(name="attention fwd+bwd", fused=fa_fwd_bwd, eager={"SDPA": sdpa_fwd_bwd},
                    flops=kt.flops("attention", **shape) * 7 // 2))

    h, W = randn(Nc, C, grad=True), randn(V, C, grad=True)
    targets = torch.randint(0, V, (Nc,), generator=g, device=device)
    out.append(dict(name="linear + CE fwd+bwd", flops=kt.flops("cross_entropy", N=Nc, C=C, V=V),
                    fused=lambda: torch.autograd.grad(fused_linear_cross_entropy(h, W, targets, chunk=chunk), (h, W)),
                    eager={"eager": lambda: torch.autograd.grad(F.cross_entropy(h @ W.T, targets), (h, W))}))
    return out


def peak_bytes(fn, device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                        help="activations' dtype (RMSNorm, attention, cross-entropy); AdamW and quantize stay fp32")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    console = Console()
    if not HAS_TRITON:
        console.print("benchmarks/kernels.py needs Triton: pip install -e .[triton]")
        return 0
    if not args.smoke and not torch.cuda.is_available():
        console.print("benchmarks/kernels.py needs a CUDA GPU (none here): it times compiled Triton kernels. "
                      "Nothing measured. `--smoke` runs it on tiny shapes under the CPU interpreter.")
        return 0
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    key = device_key(name) if device.type == "cuda" else None
    hbm = PEAK_HBM_TBS.get(key) if key else None
    flops_peak = PEAK_TFLOPS[key]["bfloat16" if dtype != torch.float32 else "tf32"] if key else None
    table = Table(title=f"tinyscale kernels vs PyTorch on {name} ({args.dtype if not args.smoke else 'smoke'})")
    for col in ("kernel", "impl", "ms", "achieved", "of peak", "peak MiB"):
        table.add_column(col, justify="left" if col in ("kernel", "impl") else "right")
    rows = []
    for case in cases(device, dtype, args.smoke):
        for impl, fn in [("tinyscale", case["fused"]), *case["eager"].items()]:
            if device.type != "cuda":  # the interpreter: a time would be Python's, not the kernel's
                fn()
                rows.append({"kernel": case["name"], "impl": impl, "ms": None})
                table.add_row(case["name"], impl, "-", "-", "-", "-")
                continue
            seconds = timed(fn, device, args.repeats)
            rows.append({"kernel": case["name"], "impl": impl, "ms": seconds * 1e3})
            if "bytes" in case:
                rate = case["bytes"] / seconds / 1e9
                achieved, frac = f"{rate:,.0f} GB/s", (f"{rate / (hbm * 1e3):.0%}" if hbm else "?")
            else:
                rate = case["flops"] / seconds / 1e12
                achieved, frac = f"{rate:,.1f} TFLOP/s", (f"{rate / flops_peak:.0%}" if flops_peak else "?")
            peak = peak_bytes(fn, device)
            table.add_row(case["name"], impl, f"{seconds * 1e3:.3f}", achieved, frac,
                          "-" if peak is None else f"{peak / 2**20:,.0f}")
    console.print(table)
    if device.type != "cuda":
        console.print("--smoke: each call ran once under Triton's CPU interpreter; nothing is timed (there a time "
                      "measures the interpreter, not a kernel).")
    console.print("GB/s: the fused kernel's minimal bytes (notebooks/kernels_traffic.py) over each time, so the "
                  f"eager rows' figure is an effective rate. Peaks: datasheet, {key or 'device not in the table'}"
                  + (f" ({hbm} TB/s HBM, {flops_peak} TFLOP/s dense)" if key else "") + ".")
    write_json(args.json, {}, device=name, dtype=str(dtype), rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
