"""GPU checks of issue 30 (scripts/gpu_checks.sh steps 5 and 6): flash-attention tiles, and the
context-parallel block kernel on a GPU.

tiles  The flash kernels at lesson 11's shape (B 4, 32 query and 8 K/V heads of 128, T 4096,
       causal, bf16) for each tile size x num_warps x num_stages that compiles: forward and
       forward+backward ms (median of 10 after 2 warm-ups, CUDA events), the largest error
       against SDPA (forward out, and dq), and SDPA's own times in the same run.
cp     `tinyscale.context_parallel.blocks` on CUDA tensors (what ring attention and Ulysses call
       per block): which kernel it takes, its (out, lse) and gradients against merge.py's float64
       reference on the CPU, full and causal blocks, GQA and padded keys, bf16 and float32.

    PYTHONPATH=src python scripts/gpu_perf.py [tiles|cp|all]     (one JSON line per result)
"""

from __future__ import annotations

import importlib
import itertools
import json
import sys
import time
import traceback

import torch
import torch.nn.functional as F


def _ms(fn, repeats: int = 10) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def tiles(deadline: float) -> None:
    fa = importlib.import_module("tinyscale.kernels.flash_attention")  # the module (the package exports the function)

    B, H, K, T, D = 4, 32, 8, 4096, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, n, T, D, device="cuda", dtype=torch.bfloat16, generator=g) for n in (H, K, K))
    dout = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = D ** -0.5
    kr, vr = k.repeat_interleave(H // K, 1), v.repeat_interleave(H // K, 1)
    qs, krs, vrs = (t.detach().requires_grad_() for t in (q, kr, vr))
    ref = F.scaled_dot_product_attention(qs, krs, vrs, is_causal=True)
    (dq_ref,) = torch.autograd.grad(ref, qs, dout, retain_graph=True)

    def sdpa_fb():
        o = F.scaled_dot_product_attention(qs, krs, vrs, is_causal=True)
        torch.autograd.grad(o, (qs, krs, vrs), dout)

    print(json.dumps({"part": "tiles", "impl": "SDPA", "fwd_ms": _ms(lambda: F.scaled_dot_product_attention(
        q, kr, vr, is_causal=True)), "fwd_bwd_ms": _ms(sdpa_fb)}), flush=True)
    configs = [(None, {})] + [(b, {"num_warps": w, "num_stages": s})
                              for b, w, s in itertools.product((64, 128), (4, 8), (2, 3))] + [(32, {"num_warps": 4,
                                                                                                     "num_stages": 3})]
    for block, launch in configs:
        if time.time() > deadline:
            print(json.dumps({"part": "tiles", "skipped": "deadline"}), flush=True)
            return
        fa.LAUNCH.clear()
        fa.LAUNCH.update(launch)
        row = {"part": "tiles", "block": block or fa._block(q, None), **launch}
        try:
            fwd = lambda: fa.flash_block(q, k, v, causal_mask_kind="causal", scale=scale, block=block)  # noqa: E731
            out, lse = fwd()
            dq, _, _ = fa.flash_block_backward(dout, q, k, v, out, lse, causal_mask_kind="causal", scale=scale,
                                               block=block)
            row["out_err"] = (out.float() - ref.float()).abs().max().item()
            row["dq_err"] = (dq.float() - dq_ref.float()).abs().max().item()
            row["fwd_ms"] = _ms(fwd)
            row["fwd_bwd_ms"] = _ms(lambda: fa.flash_block_backward(dout, q, k, v, *fwd(), causal_mask_kind="causal",
                                                                    scale=scale, block=block))
        except Exception as exc:  # noqa: BLE001 - out of shared memory etc.: report and go on
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        print(json.dumps(row), flush=True)
    fa.LAUNCH.clear()


def cp() -> None:
    from tinyscale.context_parallel import blocks
    from tinyscale.context_parallel.merge import block_attention, block_attention_backward
    from tinyscale.kernels import kernel_ok

    g = torch.Generator().manual_seed(0)
    B, H, K, T, D = 2, 8, 2, 256, 64
    q, k, v = (torch.randn(B, n, T, D, dtype=torch.float64, generator=g) for n in (H, K, K))
    dout = torch.randn(B, H, T, D, dtype=torch.float64, generator=g)
    valid = torch.arange(T) < T - 37  # padded keys
    for dtype, kind, key_valid in itertools.product((torch.bfloat16, torch.float32), ("full", "causal"),
                                                     (None, valid)):
        kw = dict(causal_mask_kind=kind, scale=D ** -0.5, key_valid=key_valid)
        want_out, want_lse = block_attention(q, k, v, **kw)
        want = block_attention_backward(dout, q, k, v, want_out, want_lse, **kw)
        qc, kc, vc, dc = (t.to("cuda", dtype) for t in (q, k, v, dout))
        kwc = dict(kw, key_valid=None if key_valid is None else key_valid.cuda())
        out, lse = blocks.attend(qc, kc, vc, **kwc)
        grads = blocks.attend_backward(dc, qc, kc, vc, out, lse, **kwc)
        err = lambda a, b: (a.double().cpu() - b).abs().max().item()  # noqa: E731
        print(json.dumps({"part": "cp", "dtype": str(dtype), "kind": kind, "padded": key_valid is not None,
                          "kernel": "triton" if kernel_ok(qc) else "other", "out_err": err(out, want_out),
                          "lse_err": err(lse, want_lse), "dq_err": err(grads[0], want[0]),
                          "dk_err": err(grads[1], want[1]), "dv_err": err(grads[2], want[2])}), flush=True)
    # one process's causal attention through Ulysses' block (BlockAttention) against SDPA, bf16, timed
    B, H, K, T, D = 1, 16, 4, 8192, 128
    qc, kc, vc = (torch.randn(B, n, T, D, device="cuda", dtype=torch.bfloat16).requires_grad_() for n in (H, K, K))

    def ours():
        o, _ = blocks.BlockAttention.apply(qc, kc, vc, "causal", D ** -0.5, None)
        torch.autograd.grad(o.sum(), (qc, kc, vc))

    def sdpa():
        o = F.scaled_dot_product_attention(qc, kc.repeat_interleave(H // K, 1), vc.repeat_interleave(H // K, 1),
                                           is_causal=True)
        torch.autograd.grad(o.sum(), (qc, kc, vc))

    print(json.dumps({"part": "cp", "shape": [B, H, K, T, D], "block_fwd_bwd_ms": _ms(ours, 5),
                      "sdpa_fwd_bwd_ms": _ms(sdpa, 5)}), flush=True)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    budget = float(sys.argv[2]) if len(sys.argv) > 2 else 120.0
    if not torch.cuda.is_available():
        sys.exit("scripts/gpu_perf.py needs a CUDA GPU")
    for part, fn in (("cp", cp), ("tiles", lambda: tiles(time.time() + budget))):
        if what in (part, "all"):
            try:
                fn()
            except Exception:  # noqa: BLE001 - one part failing leaves the other's lines
                traceback.print_exc()
