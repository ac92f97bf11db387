"""`MemoryReport`: the bytes a rank holds, by category and by where they live, counted from tensors.

Nothing here is estimated: every figure is the sum of the sizes of tensors the rank
actually holds (each storage counted once, so a tied weight is not counted twice).
Locations: "device" (the rank's compute device), "host" (CPU memory while computing on a
GPU) and "disk" (swapped out; filled in by offloading strategies). On a CPU-only run the
compute device is the CPU, so everything is "device".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

CATEGORIES = ("parameters", "gradients", "optimizer_states", "master_weights", "buffers")
LOCATIONS = ("device", "host", "disk")


@dataclass
class MemoryReport:
    """Bytes held by this rank: ``rows[(category, location)] = bytes``."""

    rows: dict[tuple[str, str], int] = field(default_factory=dict)
    peak_allocated: int | None = None  # torch.cuda.max_memory_allocated() on CUDA, else None

    def add(self, category: str, location: str, nbytes: int) -> None:
        if category not in CATEGORIES or location not in LOCATIONS:
            raise ValueError(f"unknown category/location {category!r}/{location!r}")
        self.rows[(category, location)] = self.rows.get((category, location), 0) + int(nbytes)

    def bytes(self, category: str | None = None, location: str | None = None) -> int:
        return sum(b for (c, loc), b in self.rows.items()
                   if (category is None or c == category) and (location is None or loc == location))

    @property
    def total(self) -> int:
        return self.bytes()

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer states + master weights (ZeRO's "model states")."""
        return self.total - self.bytes("buffers")

    def as_dict(self) -> dict[str, int]:
        return {c: self.bytes(c) for c in CATEGORIES} | {"total": self.total}


def unique_nbytes(tensors: Iterable[torch.Tensor]) -> dict[str, int]:
    """Bytes per device type of the given tensors, each storage region counted once.

    The engine counts every step (`Engine.memory_report(when="before_step")`), so the loop
    reads as little per tensor as it can: ``nbytes`` (numel x element size) and the device
    type from the ``is_cpu`` / ``is_cuda`` flags (``t.device`` builds a new object per call)."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, int] = {}
    for t in tensors:
        if t is None:
            continue
        nbytes = t.nbytes
        if nbytes == 0 or t.untyped_storage().nbytes() == 0:
            continue  # nothing held (ZeRO-3 frees gathered buffers, the disk tier swapped ones)
        key = (t.data_ptr(), nbytes)
        if key in seen:
            continue
        seen.add(key)
        kind = "cpu" if t.is_cpu else "cuda" if t.is_cuda else t.device.type
        out[kind] = out.get(kind, 0) + nbytes
    return out


def location_of(device_type: str, compute_device: torch.device) -> str:
    return "device" if device_type == compute_device.type else "host"


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in the optimizer's per-parameter state (exp_avg, exp_avg_sq, momentum, ...).

    Adam's scalar `step` counters are tensors too and are counted: they are state the
    optimizer holds, 4 or 8 bytes per parameter tensor.
    """
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def report_for(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
               compute_device: torch.device, extra: dict[str, list[torch.Tensor]] | None = None) -> MemoryReport:
    """Count a model, its optimizer, and `extra` tensors by category (e.g. ZeRO's shards)."""
    report = MemoryReport()
    # One walk over the modules for parameters and buffers (model.parameters() and .buffers()
    # walk them once each): a tied weight is listed twice here, and counted once below.
    params: list[torch.Tensor] = []
    buffers: list[torch.Tensor] = []
    for module in model.modules():
        params += [p for p in module._parameters.values() if p is not None]
        buffers += [b for b in module._buffers.values() if b is not None]
    groups = {
        "parameters": params,
        "gradients": [p.grad for p in params if p.grad is not None],
        "optimizer_states": optimizer_state_tensors(optimizer) if optimizer is not None else [],
        "master_weights": [],
        "buffers": buffers,
    }
    for category, tensors in (extra or {}).items():
        groups[category] = groups[category] + [t for t in tensors if t is not None]
    for category, tensors in groups.items():
        for device_type, nbytes in unique_nbytes(tensors).items():
            report.add(category, location_of(device_type, compute_device), nbytes)
    if compute_device.type == "cuda":
        report.peak_allocated = torch.cuda.max_memory_allocated(compute_device)
    return report
