"""What a counter-based dropout mask costs next to torch's stream: milliseconds per million elements.

Lesson 07, "Dropout that does not depend on the layout": the residual branch's mask (B, T, C)
drawn by `F.dropout` (torch's generator; on the CPU a Bernoulli draw per element) and by
`tinyscale.models.dropout.residual_dropout` (one splitmix64 mix per element in int64, then a
compare), forward only, on this machine's CPU (and on a GPU if one is there). The best of
`--repeats` runs of `--iters` calls each, so other processes disturb it less.

    .venv/bin/python benchmarks/counter_dropout.py [--elements 1048576] [--threads 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tinyscale.bench import add_json_argument, write_json
from tinyscale.models.dropout import SITE_MLP, DropoutClock, residual_dropout


def _best_ms(fn, iters: int, repeats: int, sync) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / iters * 1e3)
    return best


def measure(elements: int, dtype: torch.dtype, device: str, iters: int, repeats: int, p: float = 0.1) -> dict:
    C = 256
    x = torch.randn(elements // (64 * C), 64, C, dtype=dtype, device=device)  # (B, T, C)
    clock = DropoutClock(seed=0, step=1)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    per_million = 1e6 / x.numel()
    stream = _best_ms(lambda: F.dropout(x, p), iters, repeats, sync) * per_million
    counter = _best_ms(lambda: residual_dropout(x, p, clock, 0, SITE_MLP), iters, repeats, sync) * per_million
    return {"device": device, "dtype": str(dtype).removeprefix("torch."), "elements": x.numel(),
            "stream_ms_per_M": round(stream, 3), "counter_ms_per_M": round(counter, 3),
            "ratio": round(counter / stream, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    add_json_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = [measure(args.elements, dtype, device, args.iters, args.repeats)
            for device in devices for dtype in (torch.float32, torch.float64)]
    write_json(args.json, {}, rows=rows)
    print(f"{'device':6} {'dtype':8} {'F.dropout ms/M':>15} {'counter ms/M':>13} {'ratio':>6}")
    for r in rows:
        print(f"{r['device']:6} {r['dtype']:8} {r['stream_ms_per_M']:15.3f} {r['counter_ms_per_M']:13.3f} "
              f"{r['ratio']:6.2f}")


if __name__ == "__main__":
    main()
