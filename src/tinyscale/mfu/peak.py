"""Peak FLOP/s: the vendors' dense numbers by device and dtype, and a measured one for any device.

MFU's denominator is the hardware's peak for the dtype the matmuls run in, **dense** (no 2:4
structured sparsity: NVIDIA's datasheets print the sparse figure, twice the dense one, with an
asterisk; training does not use sparsity). Values in TFLOP/s per GPU, from:

- H100 SXM / PCIe / NVL: NVIDIA H100 Tensor Core GPU datasheet,
  https://www.nvidia.com/en-us/data-center/h100/ (dense = the starred sparse figure / 2),
  and the Hopper architecture whitepaper ("NVIDIA H100 Tensor Core GPU Architecture", table 1).
- H200 SXM / NVL: NVIDIA H200 datasheet, https://www.nvidia.com/en-us/data-center/h200/
  (the SXM part computes like the H100 SXM; it has more, faster memory).
- A100 (SXM and PCIe, 40 and 80 GB: the same compute): NVIDIA A100 datasheet,
  https://www.nvidia.com/en-us/data-center/a100/
- A10, L4, L40S: their NVIDIA datasheets, https://www.nvidia.com/en-us/data-center/products/
- V100 SXM2, T4: NVIDIA V100 and T4 datasheets (no bf16 on either).
- MI300X: AMD Instinct MI300X data sheet, https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html

Real chips often run below these: a lower power limit (torchtitan's H100s ran at 500 W, not
700 W), clocks that drop under sustained load. `measured_peak` times a large matmul on the
device at hand, the practical ceiling; it is also the only peak a CPU has here.

Lesson: lessons/06-mfu.md. Tests: `pytest tests/mfu -k mfu`.
"""

from __future__ import annotations

import time

import torch

# --8<-- [start:peak-table]
# TFLOP/s, dense. "float32" is the plain FP32 pipe; "tf32" the tensor cores' TF32 mode
# (what fp32 matmuls use on Ampere+ when torch.backends.cuda.matmul.allow_tf32 is on).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"float64": 67.0, "float32": 67.0, "tf32": 494.5, "bfloat16": 989.5, "float16": 989.5,
                 "float8": 1979.0},
    "H100 PCIe": {"float64": 51.0, "float32": 51.0, "tf32": 378.0, "bfloat16": 756.5, "float16": 756.5,
                  "float8": 1513.0},
    "H100 NVL": {"float64": 60.0, "float32": 60.0, "tf32": 417.5, "bfloat16": 835.5, "float16": 835.5,
                 "float8": 1670.5},
    "H200 SXM": {"float64": 67.0, "float32": 67.0, "tf32": 494.5, "bfloat16": 989.5, "float16": 989.5,
                 "float8": 1979.0},
    "H200 NVL": {"float64": 60.0, "float32": 60.0, "tf32": 417.5, "bfloat16": 835.5, "float16": 835.5,
                 "float8": 1670.5},
    "A100": {"float64": 19.5, "float32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0},
    "A10": {"float32": 31.2, "tf32": 62.5, "bfloat16": 125.0, "float16": 125.0},
    "L4": {"float32": 30.3, "tf32": 60.0, "bfloat16": 121.0, "float16": 121.0, "float8": 242.5},
    "L40S": {"float32": 91.6, "tf32": 183.0, "bfloat16": 366.5, "float16": 366.5, "float8": 733.0},
    "V100 SXM2": {"float64": 7.8, "float32": 15.7, "float16": 125.0},
    "T4": {"float32": 8.1, "float16": 65.0},
    "MI300X": {"float64": 163.4, "float32": 163.4, "tf32": 653.7, "bfloat16": 1307.4, "float16": 1307.4,
               "float8": 2614.9},
}

# torch.cuda.get_device_name() -> table key: the first rule whose words all occur in the name
# wins, so specific names come before general ones ("NVIDIA H100 80GB HBM3" is the SXM part).
_NAME_RULES: list[tuple[tuple[str, ...], str]] = [
    (("h100", "pcie"), "H100 PCIe"), (("h100", "nvl"), "H100 NVL"), (("h100",), "H100 SXM"),
    (("h200", "nvl"), "H200 NVL"), (("h200",), "H200 SXM"), (("a100",), "A100"),
    (("l40s",), "L40S"), (("l4",), "L4"), (("a10",), "A10"), (("v100",), "V100 SXM2"), (("t4",), "T4"),
    (("mi300x",), "MI300X"),
]
# --8<-- [end:peak-table]

_DTYPE_KEYS = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16",
               torch.float16: "float16", torch.float8_e4m3fn: "float8", torch.float8_e5m2: "float8"}


def device_key(name: str) -> str | None:
    """The table key for a device name as torch reports it, or None if the table lacks it."""
    words = set(name.lower().replace("-", " ").split())  # "A100-SXM4-80GB" -> a100, sxm4, 80gb
    for needed, key in _NAME_RULES:
        if all(word in words for word in needed):
            return key
    return None


def dtype_key(dtype: torch.dtype | str) -> str:
    """"float32", "tf32", "bfloat16", ... for a torch dtype or one of those names."""
    if isinstance(dtype, str):
        if dtype not in {k for row in PEAK_TFLOPS.values() for k in row}:
            raise ValueError(f"dtype {dtype!r} is unknown: use a torch dtype or one of "
                             "float64, float32, tf32, bfloat16, float16, float8")
        return dtype
    if dtype not in _DTYPE_KEYS:
        raise ValueError(f"dtype {dtype} has no peak in the table: use float64, float32, bfloat16, "
                         "float16 or a float8 dtype")
    return _DTYPE_KEYS[dtype]


def peak_flops(device: str | torch.device, dtype: torch.dtype | str) -> float:
    """Dense peak FLOP/s of one device for matmuls in `dtype`, from PEAK_TFLOPS.

    `device`: a table key ("H100 SXM"), a name as torch.cuda.get_device_name() gives it
    ("NVIDIA H100 80GB HBM3"), or a CUDA torch.device (its name is looked up). A CPU has no
    table entry: use `measured_peak`."""
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"no vendor peak for device type {device.type!r}: use measured_peak(device, dtype)")
        device = torch.cuda.get_device_name(device)
    key = device if device in PEAK_TFLOPS else device_key(device)
    if key is None:
        raise ValueError(f"device {device!r} is not in the peak table: pass one of {sorted(PEAK_TFLOPS)}, "
                         "or measure it with measured_peak(device, dtype)")
    name = dtype_key(dtype)
    if name not in PEAK_TFLOPS[key]:
        raise ValueError(f"{key} has no {name} peak in the table (it supports {sorted(PEAK_TFLOPS[key])}): "
                         "pick one of those dtypes")
    return PEAK_TFLOPS[key][name] * 1e12


# --8<-- [start:measured-peak]
def measured_peak(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, *,
                  max_seconds: float = 1.5, max_size: int = 8192) -> float:
    """FLOP/s of the fastest square matmul this device runs, in about `max_seconds` or less.

    Grows n (256, 512, ...) while one n x n matmul takes under ~1/20 of the budget, then
    times repeats at the largest size and keeps the fastest: a peak is a best case, and on
    a machine shared with other jobs the slower repeats measure the neighbours. On CUDA the
    stream is synchronised around each timed call (kernels are asynchronous)."""
    device = torch.device(device)
    if not max_seconds > 0:
        raise ValueError(f"max_seconds={max_seconds!r} must be > 0")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def timed(a: torch.Tensor, b: torch.Tensor) -> float:
        sync()
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        return time.perf_counter() - start

    deadline = time.perf_counter() + max_seconds
    n, best = 256, 0.0
    while True:
        a = torch.randn(n, n, device=device).to(dtype)  # randn first: not every dtype can draw
        b = torch.randn(n, n, device=device).to(dtype)
        timed(a, b)  # warm-up: kernel selection, thread pool start, caches
        seconds = timed(a, b)
        best = max(best, 2 * n**3 / seconds)
        if seconds > max_seconds / 20 or 2 * n > max_size or time.perf_counter() + 8 * seconds > deadline:
            break
        n *= 2
    while time.perf_counter() + seconds < deadline:
        seconds = timed(a, b)
        best = max(best, 2 * n**3 / seconds)
    return best
# --8<-- [end:measured-peak]
