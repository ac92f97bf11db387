"""FLOPs, MFU and a step profiler: how much of the hardware a training step really uses.

    from tinyscale.mfu import forward_flops, mfu, peak_flops, measured_peak, WindowedMFU, StepProfiler
    f = forward_flops(cfg, seq_len=T)          # exact matmul FLOPs, by part (= FlopCounterMode's count)
    mfu(tokens_per_s, cfg, peak_flops("H100 SXM", torch.bfloat16), seq_len=T)
    prof = StepProfiler(); with prof.step(): with prof.phase("forward"): ...

- `flops.py`: exact matmul FLOPs of the GPT's forward, backward and recomputation from its
  config, and on a tp x cp layout (`layout_flops`: what HFU counts); 6N, 6N + 12LHQT (PaLM,
  appendix B) beside them.
- `peak.py`: vendors' dense peak FLOP/s by device and dtype; `measured_peak` from a matmul.
- `mfu.py`: `mfu`, `hfu`, `WindowedMFU` (sums over a window), and nanoGPT's running MFU
  replayed as the anti-example.
- `timeline.py`: one step's time split into forward, backward, optimizer, exposed
  communication and other, plus hidden communication (pure interval arithmetic).
- `profiler.py`: `StepProfiler`, which records those intervals (explicit phases or hooks,
  communication from the comm ledger); `report.py`: Chrome trace, summary table, torch.profiler.

Lesson: lessons/06-mfu.md. Notebook: notebooks/06-mfu.ipynb. Tests: `pytest tests/mfu -k "mfu or profile"`.
"""

from tinyscale.mfu.flops import (
    RECOMPUTE,
    ForwardFlops,
    approximations,
    attention_share,
    forward_flops,
    hardware_flops_per_token,
    layout_flops,
    matmul_params,
    model_flops_per_token,
)
from tinyscale.mfu.mfu import WindowedMFU, hfu, mfu, nanogpt_running_mfu
from tinyscale.mfu.peak import PEAK_TFLOPS, device_key, measured_peak, peak_flops
from tinyscale.mfu.profiler import CommSpan, MemorySample, StepProfiler, StepRecord
from tinyscale.mfu.report import (
    chrome_trace,
    merge_chrome_traces,
    print_table,
    save_chrome_trace,
    summary,
    table,
    torch_trace,
)
from tinyscale.mfu.timeline import CATEGORIES, PHASES, StepBreakdown, breakdown

__all__ = [
    "CATEGORIES",
    "PEAK_TFLOPS",
    "PHASES",
    "RECOMPUTE",
    "CommSpan",
    "ForwardFlops",
    "MemorySample",
    "StepBreakdown",
    "StepProfiler",
    "StepRecord",
    "WindowedMFU",
    "approximations",
    "attention_share",
    "breakdown",
    "chrome_trace",
    "device_key",
    "forward_flops",
    "hardware_flops_per_token",
    "hfu",
    "layout_flops",
    "matmul_params",
    "measured_peak",
    "merge_chrome_traces",
    "mfu",
    "model_flops_per_token",
    "nanogpt_running_mfu",
    "peak_flops",
    "print_table",
    "save_chrome_trace",
    "summary",
    "table",
    "torch_trace",
]
