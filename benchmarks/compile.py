"""Eager against compiled blocks (`compile: {"enabled": true}`, inductor) on the CPU: step time and kernels.

    python benchmarks/compile.py [--d-model 128] [--layers 4] [--rows 8] [--seq 128] [--steps 20] [--threads 1] [--json PATH]

One process, float32, two engines built from the same GPT (tinyscale.initialize, ZeRO 0, AdamW),
one eager and one with its blocks compiled by inductor (engine/compiled.py). It reports:

- compile time: the compiled engine's first step minus the eager engine's first step (Dynamo's
  capture, AOTAutograd's forward and backward graphs, inductor's C++ code generation and build),
  cold: inductor's cache goes to a fresh temporary folder unless TORCHINDUCTOR_CACHE_DIR is set
  (a warm cache skips the C++ build);
- step time: the fastest and the median of `--steps` steps of each, interleaved (eager, compiled,
  eager, ...) so that load changes hit both alike, after 2 warm-up steps each, and the ratios
  compiled / eager of both (on a shared machine the fastest step is the steadier one);
- kernels per block, forward and backward: eager, the ATen operators one block's forward and
  backward run (a TorchDispatchMode counts them, views excluded); compiled, the calls in inductor's
  generated code for the same block: its fused C++ loops (`cpp_fused_*`) and the library calls it
  keeps (`extern_kernels.*`: the matmuls, and attention where it is not decomposed).

Lesson: lessons/12-engine.md, "Fusion: what DeepSpeed injects and what torch.compile does".
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time

import torch
from rich.console import Console
from rich.table import Table
from torch.utils._python_dispatch import TorchDispatchMode

import tinyscale as ts
from tinyscale.bench import add_json_argument, write_json
from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _block_input(model: GPT, rows: int, seq: int):
    x = torch.randn(rows, seq, model.config.d_model, requires_grad=True)
    return x, model.rope_cos[:seq], model.rope_sin[:seq]


def eager_block_ops(model: GPT, rows: int, seq: int) -> int:
    """ATen operators (views excluded) of one block's forward and backward, eagerly."""
    x, cos, sin = _block_input(model, rows, seq)
    with _CountOps() as mode:
        model.blocks[0](x, cos, sin).sum().backward()
    return len(mode.ops)


def compiled_block_kernels(model: GPT, rows: int, seq: int) -> tuple[int, int]:
    """(fused C++ kernels, library calls) in inductor's code for one block's forward and backward."""
    from torch._inductor.utils import run_and_get_code

    x, cos, sin = _block_input(model, rows, seq)
    block = model.blocks[0]
    torch._dynamo.reset()
    fn = torch.compile(block.forward, backend="inductor")
    _, code = run_and_get_code(lambda: fn(x, cos, sin).sum().backward())
    calls = [c[c.index("def call("):] for c in code if "def call(" in c]
    fused = sum(len(re.findall(r"^\s+cpp_fused_\w+\(", c, re.M)) for c in calls)
    extern = sum(len(re.findall(r"^\s+(?:buf\d+ = )?extern_kernels\.\w+\(", c, re.M)) for c in calls)
    extern += sum(len(re.findall(r"^\s+\w+ = torch\.ops\.aten\.\w+", c, re.M)) for c in calls)
    return fused, extern


def engine(cfg: GPTConfig, compiled: bool, rows: int):
    config = {"train_batch_size": rows, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if compiled:
        config["compile"] = {"enabled": True, "backend": "inductor"}
    return ts.initialize(GPT(cfg, seed=0), config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (1: less sensitive to load)")
    add_json_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))  # cold, before compiling
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, max_seq_len=args.seq, n_layer=args.layers, n_head=4, d_model=args.d_model)
    batches = synthetic_token_batches(num_batches=args.steps + 3, batch_size=args.rows, seq_len=args.seq,
                                      vocab_size=256, seed=1)
    eager, comp = engine(cfg, False, args.rows), engine(cfg, True, args.rows)
    start = time.perf_counter()
    eager.train_batch(batches[0])
    first_eager = time.perf_counter() - start
    start = time.perf_counter()
    comp.train_batch(batches[0])
    first_compiled = time.perf_counter() - start
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for i, batch in enumerate(batches[1:]):
        for name, eng in (("eager", eager), ("compiled", comp)):
            start = time.perf_counter()
            eng.train_batch(batch)
            if i >= 2:  # warm-up dropped
                times[name].append(time.perf_counter() - start)
    median = {k: statistics.median(v) for k, v in times.items()}
    spread = {k: (min(v), max(v)) for k, v in times.items()}
    ops = eager_block_ops(GPT(cfg, seed=0), args.rows, args.seq)
    fused, extern = compiled_block_kernels(GPT(cfg, seed=0), args.rows, args.seq)

    table = Table(title=f"GPT d_model {args.d_model}, {args.layers} layers, {args.rows} x {args.seq} tokens, "
                        f"float32, CPU ({torch.get_num_threads()} threads)")
    for col in ("", "first step (s)", "fastest step (ms)", "median step (ms)", "kernels per block (fwd + bwd)"):
        table.add_column(col)
    table.add_row("eager", f"{first_eager:.2f}", f"{spread['eager'][0] * 1e3:.1f}",
                  f"{median['eager'] * 1e3:.1f}", f"{ops} ATen ops")
    table.add_row("compiled (inductor)", f"{first_compiled:.2f}", f"{spread['compiled'][0] * 1e3:.1f}",
                  f"{median['compiled'] * 1e3:.1f}", f"{fused + extern} ({fused} fused C++ + {extern} library calls)")
    console = Console()
    console.print(table)
    ratio = median["compiled"] / median["eager"]
    fastest = spread["compiled"][0] / spread["eager"][0]
    console.print(f"compile time ~ {first_compiled - first_eager:.1f} s; step time compiled / eager: fastest "
                  f"{fastest:.2f}, median {ratio:.2f}")
    write_json(args.json, {"compiled_over_eager": ratio, "compiled_over_eager_fastest": fastest},
               compile_s=first_compiled - first_eager,
               eager_ms=median["eager"] * 1e3, compiled_ms=median["compiled"] * 1e3, eager_block_ops=ops,
               compiled_block_kernels={"fused": fused, "extern": extern}, args=vars(args))


if __name__ == "__main__":
    main()
