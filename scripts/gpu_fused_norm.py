"""Sweep the fused dropout + residual + LayerNorm kernel's warps on a GPU (lesson 11, DS-32).

    python scripts/gpu_fused_norm.py        # bf16, (8, 1024, 4096): ms forward and forward + backward per setting
    python scripts/gpu_fused_norm.py bwd    # the backward alone per (programs per SM, backward warps), checked
    python scripts/gpu_fused_norm.py device # kernel time on the device (profiler) and CUDA-graph replay: launch cost out

One process, CUDA only; eager `LayerNorm(residual + F.dropout(x))` timed in the same run as the baseline.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from tinyscale.kernels import fused_norm


def main() -> None:
    torch.manual_seed(0)
    B, T, C, dtype = 8, 1024, 4096, torch.bfloat16
    x, r = (torch.randn(B, T, C, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    w, b = torch.ones(C, device="cuda", dtype=dtype, requires_grad=True), torch.zeros(C, device="cuda", dtype=dtype,
                                                                                         requires_grad=True)
    g = torch.randn(B, T, C, device="cuda", dtype=dtype)

    def eager():
        h = r + F.dropout(x, 0.1)
        return F.layer_norm(h, (C,), w, b), h

    def fused():
        return fused_norm.fused_dropout_residual_layer_norm(x, r, w, b, p=0.1, key=1234)

    def both(fn):
        y, h = fn()
        torch.autograd.backward((y, h), (g, g))

    print(f"{'setting':>10} {'fwd ms':>8} {'fwd+bwd ms':>11}")
    print(f"{'eager':>10} {do_bench(eager):8.3f} {do_bench(lambda: both(eager)):11.3f}")
    for warps in (None, 4, 8, 16, 32):
        fused_norm.WARPS = warps
        name = f"rule {fused_norm._warps(4096)}" if warps is None else str(warps)
        print(f"{name:>10} {do_bench(fused):8.3f} {do_bench(lambda: both(fused)):11.3f}")


def _inputs() -> tuple[torch.Tensor, ...]:
    """x, residual (8, 1024, 4096) bf16 with gradients; LayerNorm weight and bias near 1 and 0; two
    output gradients: the backward sweep's and the device timing's inputs (seed 0)."""
    torch.manual_seed(0)
    B, T, C, dtype = 8, 1024, 4096, torch.bfloat16
    x, r = (torch.randn(B, T, C, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    w = (1 + 0.1 * torch.randn(C, device="cuda", dtype=dtype)).requires_grad_()
    b = (0.1 * torch.randn(C, device="cuda", dtype=dtype)).requires_grad_()
    g1, g2 = (torch.randn(B, T, C, device="cuda", dtype=dtype) for _ in range(2))
    return x, r, w, b, g1, g2


def backward_sweep() -> None:
    """The backward kernel alone (forward outside the timing) per programs-per-SM x warps, each
    checked against eager's gradients on the same inputs (largest error over max |eager grad|)."""
    x, r, w, b, g1, g2 = _inputs()
    C = x.shape[-1]
    y0, h0 = F.layer_norm(r + F.dropout(x, 0.0), (C,), w, b), r + x  # p = 0 so eager's gradients are the truth
    ref = torch.autograd.grad((y0, h0), (x, r, w, b), (g1, g2))
    y_e, h_e = (lambda h: (F.layer_norm(h, (C,), w, b), h))(r + F.dropout(x, 0.1))
    eager_ms = do_bench(lambda: torch.autograd.grad((y_e, h_e), (x, r, w, b), (g1, g2), retain_graph=True))
    print(f"eager backward {eager_ms:.3f} ms")
    print(f"{'backward':>9} {'setting':>22} {'warps':>5} {'bwd ms':>7} {'max rel err':>11}")
    settings = [("rows", f"{per_sm} per SM", warps, (per_sm, fused_norm.DW_TILE)) for per_sm in (2, 4)
                for warps in (4, 8)]
    settings += [("two_pass", f"BM,BN,ROWS {tile}", warps, (4, tile)) for tile in ((32, 64, 256), (16, 128, 512),
                                                                                  (64, 32, 256), (32, 64, 1024))
                 for warps in (None, 4, 16)]
    default = (fused_norm.BACKWARD, fused_norm.PROGRAMS_PER_SM, fused_norm.DW_TILE, fused_norm.BWD_WARPS)
    for kind, name, warps, (per_sm, tile) in settings:
        fused_norm.BACKWARD, fused_norm.PROGRAMS_PER_SM, fused_norm.DW_TILE, fused_norm.BWD_WARPS = kind, per_sm, \
            tile, warps
        y, h = fused_norm.fused_dropout_residual_layer_norm(x, r, w, b, p=0.0, key=1)
        got = torch.autograd.grad((y, h), (x, r, w, b), (g1, g2), retain_graph=True)
        err = max(((a.float() - e.float()).abs().max() / e.float().abs().max()).item() for a, e in zip(got, ref))
        ms = do_bench(lambda: torch.autograd.grad((y, h), (x, r, w, b), (g1, g2), retain_graph=True))
        print(f"{kind:>9} {name:>22} {warps or 'rule':>5} {ms:7.3f} {err:11.2e}")
    fused_norm.BACKWARD, fused_norm.PROGRAMS_PER_SM, fused_norm.DW_TILE, fused_norm.BWD_WARPS = default


def _device_ms(fn, n: int = 20) -> tuple[float, list[str]]:
    """Milliseconds per call that the GPU spends in kernels (the profiler's device time, so host launch
    cost is out), and the kernels' names with their share."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.self_device_time_total) for e in prof.key_averages() if e.self_device_time_total > 0]
    total_us = sum(t for _, t in rows)
    names = [f"{t / total_us:5.1%} {k[:70]}" for k, t in sorted(rows, key=lambda r: -r[1])[:4]]
    return total_us / n / 1e3, names


def _graph_ms(fn) -> float:
    """Milliseconds per replay of `fn` captured as one CUDA graph (one launch for all its kernels)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay)


def device_times() -> None:
    """Forward and backward alone, eager and each fused backward: do_bench (host launches included),
    kernel time on the device (profiler) and CUDA-graph replay. If the fused kernels lose only with the
    host in the loop, the gap is launch cost, not the kernels."""
    x, r, w, b, g1, g2 = _inputs()
    C = x.shape[-1]

    def eager():
        h = r + F.dropout(x, 0.1)
        return F.layer_norm(h, (C,), w, b), h

    def fused():
        return fused_norm.fused_dropout_residual_layer_norm(x, r, w, b, p=0.1, key=1234)

    cases = [("eager", eager, None), ("fused rows", fused, "rows"), ("fused two_pass", fused, "two_pass")]
    print(f"{'case':>15} {'part':>4} {'do_bench ms':>11} {'device ms':>9} {'graph ms':>8}  kernels (share of device time)")
    default = fused_norm.BACKWARD
    for name, fn, kind in cases:
        fused_norm.BACKWARD = kind or default
        y, h = fn()
        bwd = lambda: torch.autograd.grad((y, h), (x, r, w, b), (g1, g2), retain_graph=True)  # noqa: E731
        for part, f in (("fwd", fn), ("bwd", bwd)):  # the forward without autograd: its kernels only
            ctx = torch.no_grad() if part == "fwd" else torch.enable_grad()
            with ctx:
                bench = do_bench(f)
                dev, names = _device_ms(f)
                try:
                    graph = f"{_graph_ms(f):8.3f}"
                except Exception as exc:  # noqa: BLE001 - report, keep timing the rest
                    graph = f"failed: {type(exc).__name__}"
            print(f"{name:>15} {part:>4} {bench:11.3f} {dev:9.3f} {graph:>8}  " + " | ".join(names))
    fused_norm.BACKWARD = default


if __name__ == "__main__":
    import sys

    {"bwd": backward_sweep, "device": device_times}.get((sys.argv[1:] or [""])[0], main)()
