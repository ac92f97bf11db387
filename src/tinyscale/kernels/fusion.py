"""What fusing an elementwise chain removes, counted on the CPU (OPT-1).

The chain is a transformer MLP's tail: bias + GeLU + dropout + residual. Eager PyTorch runs
it as one ATen kernel per op; `eager_traffic` counts those ops under a dispatch mode, with
the intermediates each one writes to memory and the bytes it reads and writes (views are
metadata and are skipped). `compiled_traffic` compiles the same function with
`torch.compile` (inductor, C++ on a CPU) and reads the generated wrapper: how many kernels
it calls and how many buffers it allocates. The fused kernel's bytes are its arguments, each
read or written once. `time_chain` times both; a timing is reported, never asserted (the
machine is shared). Launch overhead and HBM bandwidth are a GPU's: see lesson 11.

The dropout mask is an argument, so both paths draw the same one and their values can be
compared (eager `F.dropout` draws it inside, with its own generator).

Tests: `pytest -k fusion_opt1`.
"""

from __future__ import annotations

import re
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


# --8<-- [start:chain]
def bias_gelu_dropout_residual(x: torch.Tensor, bias: torch.Tensor, keep: torch.Tensor,
                               residual: torch.Tensor, p: float = 0.1) -> torch.Tensor:
    """residual + dropout(gelu(x + bias)), with the dropout's keep-mask (0/1) given."""
    return residual + F.gelu(x + bias) * keep * (1.0 / (1.0 - p))
# --8<-- [end:chain]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Traffic(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.read = self.written = 0
        self.outputs: list[int] = []  # bytes of each tensor an op wrote

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.ops.append(func.__name__)
            self.read += sum(_nbytes(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.written += _nbytes(t)
                    self.outputs.append(_nbytes(t))
        return out


def eager_traffic(fn, *args) -> dict:
    """Run fn(*args) eagerly: ATen ops launched, intermediates (every tensor an op wrote but
    the result), bytes read and written over all ops."""
    with _Traffic() as mode:
        out = fn(*args)
    return {"out": out, "kernels": len(mode.ops), "ops": mode.ops, "intermediates": len(mode.outputs) - 1,
            "intermediate_bytes": sum(mode.outputs) - _nbytes(out),
            "bytes": mode.read + mode.written}


def compiled_traffic(fn, *args) -> dict:
    """Compile fn with inductor (no cache, so the code is generated here) and read its wrapper:
    the kernels it calls and the buffers it allocates. Bytes: each kernel argument once."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False):
        out, code = run_and_get_code(torch.compile(fn), *args)
    src = "\n".join(code)  # one module per compiled graph: a graph break makes two
    calls = [s[s.index("def call("):] for s in code]
    kernels = [k for c in calls for k in re.findall(r"^\s+(cpp_fused_\w+|triton_\w+)\(", c, re.M)]
    buffers = [b for c in calls for b in re.findall(r"^\s+(buf\d+) = empty_strided", c, re.M)]
    return {"out": out, "kernels": len(kernels), "names": kernels, "buffers": len(buffers),
            "intermediates": len(buffers) - 1,
            "bytes": sum(_nbytes(a) for a in args) + _nbytes(out), "code": src}


def time_chain(fn, args, repeats: int = 20) -> float:
    """Best seconds of fn(*args) over `repeats` calls, after one warm-up."""
    fn(*args)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


def chain_inputs(rows: int, hidden: int, p: float = 0.1, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g)
    keep = (torch.rand(rows, hidden, generator=g) >= p).float()
    return x, torch.randn(hidden, generator=g), keep, torch.randn(rows, hidden, generator=g)


if __name__ == "__main__":  # python -m tinyscale.kernels.fusion: the numbers in lesson 11
    for rows, hidden in [(64, 256), (4096, 1024)]:
        args = chain_inputs(rows, hidden)
        e, c = eager_traffic(bias_gelu_dropout_residual, *args), compiled_traffic(bias_gelu_dropout_residual, *args)
        compiled = torch.compile(bias_gelu_dropout_residual)
        te, tc = time_chain(bias_gelu_dropout_residual, args), time_chain(compiled, args)
        print(f"{rows}x{hidden}: eager {e['kernels']} ops {e['ops']}, {e['intermediates']} intermediates, "
              f"{e['bytes']:,} B; compiled {c['kernels']} kernel(s) {c['names']}, {c['buffers']} buffer(s), "
              f"{c['bytes']:,} B; max |diff| {(e['out'] - c['out']).abs().max().item():.2e}; "
              f"best of 20: eager {te * 1e6:.0f} us, compiled {tc * 1e6:.0f} us "
              f"({torch.get_num_threads()} threads)")
