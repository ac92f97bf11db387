"""ZeRO's arithmetic: model-state bytes per device and communication per step, stage by stage.

From Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (2020): section 5 (memory), section 7 (communication), Table 1; offload from Ren et
al., "ZeRO-Offload" (2021) and ZeRO-Infinity (2021). Lesson: lessons/03-zero.md. Run it:
``tinyscale estimate --params 7.5e9 --dp 64``. Pure arithmetic: no torch, no processes.

Notation and units (the paper's):
    Psi   parameters (elements)
    N_d   data-parallel degree: the ranks the model states are sharded over
    K     optimizer bytes per parameter; mixed-precision Adam: 12 = fp32 master weights 4 +
          momentum 4 + variance 4 (reported apart, as `engine.memory_report()` does)
    2, 2  bytes per fp16 parameter and fp16 gradient (``param_bytes``, ``grad_bytes``)
    bytes are bytes; GB = 1e9 bytes (the paper's); communication volume is in elements

Per-device model states (P_os, P_os+g, P_os+g+p are the paper's names):
    stage 0, DDP        2Psi + 2Psi + K Psi             = 16 Psi
    stage 1, P_os       2Psi + 2Psi + K Psi / N_d       = 4 Psi + 12 Psi / N_d
    stage 2, P_os+g     2Psi + (2 + K) Psi / N_d        = 2 Psi + 14 Psi / N_d
    stage 3, P_os+g+p   (2 + 2 + K) Psi / N_d           = 16 Psi / N_d
Correction to the source documents: stage 1 is NOT "2Psi + Psi/N_d". Only the optimizer
states (and master weights) shrink; fp16 parameters and gradients stay whole. Counted in
fp32 elements (pure-fp32 Adam) it is Psi + Psi + 3 Psi / N_d: m, v and an fp32 master copy of
the shard, which tinyscale's engine, like DeepSpeed, keeps at stage >= 1 even when the
parameters are fp32 (2 Psi / N_d for an optimizer that steps the parameters themselves).

Not counted (they are not model states): activations and their checkpoints, temporary
buffers (stage 2's gradient buckets in flight, stage 3's gathered full parameters of the
module being run and its prefetch), communication buffers, and allocator fragmentation.
Psi / N_d is the ideal share: an implementation pads each flat buffer to a multiple of N_d
(at most N_d - 1 elements per buffer; see `tinyscale.zero.flat`), which is left out here;
`tinyscale.engine.layout_memory` counts it (and the engine's units) exactly, per rank.

Offload, per rank (host = CPU memory, disk = NVMe). ``offload`` is where the optimizer goes
(DeepSpeed's offload_optimizer.device), ``offload_params`` where the parameter shard goes
(offload_param.device). Offload moves bytes between places; it never changes the total.
    stage 2, offload="cpu" (ZeRO-Offload)  device: the fp16 parameters, 2 Psi, nothing else.
        host: this rank's gradient shard 2 Psi / N_d (fp16 gradients leave the device once
        reduced) + master weights and Adam states K Psi / N_d; the CPU steps and sends the
        fp16 shard back to be all-gathered. The paper counts host gradients at 2 bytes;
        DeepSpeed's CPU Adam keeps them in fp32 (4 bytes).
    offload="nvme": master weights and optimizer states on disk; the gradient shard stays
        in host memory, where the CPU optimizer reads it.
    stage 3, offload_params="cpu"|"nvme" (ZeRO-Infinity): the fp16 parameter shard too; the
        device then holds no model state between uses, only the gathered working set.
Offload needs stage 2 or 3: ZeRO-Offload builds on stage 2, whose gradient partitioning
lets each rank send only 1/N_d of the gradients to the host. Its host-device traffic (per
rank per step: gradient shard out, fp16 shard back, 4 Psi / N_d bytes) is not in `comm_volume`.

Communication per rank per optimizer step (section 7), in elements: DDP's all-reduce is a
reduce-scatter (Psi) plus an all-gather (Psi), 2 Psi. Stages 1 and 2 run the same two, with
each rank's optimizer step between them (stage 2 reduce-scatters during backward): 2 Psi.
Stage 3 all-gathers the parameters for forward, again for backward, then reduce-scatters
the gradients: 3 Psi, 1.5x DDP. Stage 1 never moves optimizer states (and all-reducing the
gradients AND all-gathering the parameters would cost 3 Psi). The paper rounds each
collective to Psi: over a ring of N ranks it sends exactly (N - 1)/N Psi per rank, which is
`comm_bytes_per_rank` and what `tinyscale.dist.comm.Ledger.bus_bytes()` measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal

STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "DDP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
OFFLOAD_TARGETS = ("none", "cpu", "nvme")
CATEGORIES = ("parameters", "gradients", "master_weights", "optimizer_states")  # engine.memory's
LOCATIONS = ("device", "host", "disk")
_WHERE = {"none": "device", "cpu": "host", "nvme": "disk"}
GB = 1e9  # the paper's GB
TABLE1_DPS = (1, 4, 16, 64, 256, 1024)  # the data-parallel degrees of the paper's Table 1
COLLECTIVES = {  # what each stage communicates per step (one micro-batch)
    0: "all-reduce gradients (= reduce-scatter + all-gather)",
    1: "reduce-scatter gradients, all-gather parameters",
    2: "reduce-scatter gradients (in backward), all-gather parameters",
    3: "all-gather parameters (forward, backward), reduce-scatter gradients",
}


@dataclass(frozen=True)
class States:
    """Model-state bytes in one place, by category."""

    parameters: float = 0.0
    gradients: float = 0.0
    master_weights: float = 0.0
    optimizer_states: float = 0.0  # momentum + variance (K minus the master weights)

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.master_weights + self.optimizer_states


@dataclass(frozen=True)
class Breakdown:
    """Model-state bytes one rank holds on its device, in host memory and on disk."""

    num_params: float
    dp: int
    stage: int
    offload: str
    offload_params: str
    device: States
    host: States
    disk: States

    @property
    def total(self) -> float:
        """Every place together: what offload cannot change."""
        return self.device.total + self.host.total + self.disk.total

    def bytes(self, category: str | None = None, location: str | None = None) -> float:
        """Like `MemoryReport.bytes`: the sum over one category and/or one location."""
        if category not in (None, *CATEGORIES) or location not in (None, *LOCATIONS):
            raise ValueError(f"unknown {category!r}/{location!r}: use one of {CATEGORIES}/{LOCATIONS}")
        return sum(getattr(getattr(self, loc), cat)
                   for loc in (LOCATIONS if location is None else (location,))
                   for cat in (CATEGORIES if category is None else (category,)))


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _check(num_params, dp, stage, offload="none", offload_params="none", **nbytes) -> None:
    if not _number(num_params):
        raise ValueError(f"num_params={num_params!r}: give a finite number of parameters >= 0")
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ValueError(f"dp={dp!r}: the data-parallel degree is an int >= 1")
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r}: ZeRO stages are 0 (DDP), 1, 2 and 3")
    for name, value in nbytes.items():
        if not _number(value):
            raise ValueError(f"{name}={value!r}: bytes per element must be a finite number >= 0")
    if nbytes.get("master_bytes", 0) > nbytes.get("optimizer_bytes", math.inf):
        raise ValueError(f"master_bytes > optimizer_bytes in {nbytes}: K includes the master weights")
    for name, value in (("offload", offload), ("offload_params", offload_params)):
        if value not in OFFLOAD_TARGETS:
            raise ValueError(f"{name}={value!r}: use one of {OFFLOAD_TARGETS}")
    if offload != "none" and stage < 2:
        raise ValueError(f"offload={offload!r} needs stage 2 or 3 (ZeRO-Offload builds on stage 2's "
                         f"gradient partitioning), got stage {stage}")
    if offload_params != "none" and stage != 3:
        raise ValueError(f"offload_params={offload_params!r} needs stage 3 (only stage 3 shards the "
                         f"parameters), got stage {stage}")


# --8<-- [start:placement]
def _placement(stage, offload, offload_params, param_bytes, grad_bytes, optimizer_bytes):
    """(what, bytes per element, sharded over N_d?, where) for each part of the model states:
    ZeRO in three lines. Stage s shards the first s of (optimizer, gradients, parameters)."""
    return [
        ("parameters", param_bytes, stage >= 3, _WHERE[offload_params]),
        ("gradients", grad_bytes, stage >= 2, "device" if offload == "none" else "host"),
        ("optimizer", optimizer_bytes, stage >= 1, _WHERE[offload]),  # master weights included
    ]
# --8<-- [end:placement]


def model_state_bytes(num_params: float, dp: int, stage: int, *, offload: str = "none",
                      offload_params: str = "none", param_bytes: float = 2, grad_bytes: float = 2,
                      optimizer_bytes: float = 12, master_bytes: float = 4) -> Breakdown:
    """Model-state bytes per rank for `stage` at data-parallel degree `dp` (see the module doc).
    Defaults: mixed-precision Adam (2 + 2 + 12 bytes per parameter, 4 of the 12 master weights).
    Pure-fp32 Adam as the engine runs it (`engine.memory_report()`): at stage 0
    ``param_bytes=4, grad_bytes=4, optimizer_bytes=8, master_bytes=0``; at stage >= 1 the shard
    has an fp32 master copy besides the fp32 parameters, as in DeepSpeed:
    ``param_bytes=4, grad_bytes=4, optimizer_bytes=12, master_bytes=4``."""
    _check(num_params, dp, stage, offload, offload_params, param_bytes=param_bytes,
           grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes, master_bytes=master_bytes)
    places: dict[str, dict[str, float]] = {loc: {} for loc in LOCATIONS}
    for what, per_element, sharded, where in _placement(stage, offload, offload_params,
                                                        param_bytes, grad_bytes, optimizer_bytes):
        elements = num_params / dp if sharded else num_params
        if what == "optimizer":  # report the master weights apart, like engine.memory_report()
            places[where]["master_weights"] = master_bytes * elements
            places[where]["optimizer_states"] = (per_element - master_bytes) * elements
        else:
            places[where][what] = per_element * elements
    return Breakdown(num_params, dp, stage, offload, offload_params,
                     **{loc: States(**cats) for loc, cats in places.items()})


def formula(stage: int, location: str = "device", *, offload: str = "none", offload_params: str = "none",
            param_bytes: float = 2, grad_bytes: float = 2, optimizer_bytes: float = 12) -> str:
    """The paper's expression for one place, e.g. stage 2 on the device: '2Ψ + (2 + 12)Ψ/N'."""
    _check(0, 1, stage, offload, offload_params)
    if location not in LOCATIONS:
        raise ValueError(f"location={location!r}: use one of {LOCATIONS}")
    parts = [(b, sharded) for _, b, sharded, where in _placement(
        stage, offload, offload_params, param_bytes, grad_bytes, optimizer_bytes) if where == location]
    terms = [f"{b:g}Ψ" for b, sharded in parts if not sharded]
    shards = [f"{b:g}" for b, sharded in parts if sharded]
    if shards:
        terms.append(f"{shards[0]}Ψ/N" if len(shards) == 1 else f"({' + '.join(shards)})Ψ/N")
    return " + ".join(terms) or "0"


def round_like_paper(gb: float) -> float:
    """Round half up as Table 1 does: one decimal from 10 GB up, two below (41.25 -> 41.3);
    a rule inferred from the table itself (52.5, 41.3, 7.5, 1.88, 0.47, 0.12)."""
    places = Decimal("0.1") if gb >= 10 else Decimal("0.01")
    return float(Decimal(repr(gb)).quantize(places, rounding=ROUND_HALF_UP))


def table1(num_params: float = 7.5e9, dps: tuple[int, ...] = TABLE1_DPS,
           **kwargs) -> dict[int, tuple[float, ...]]:
    """ZeRO's Table 1: {stage: per-device model states in GB at each dp}, rounded like the paper.
    Stage 0 is included (the baseline, 16 Psi at every dp); the paper shows it as the dp=1 row."""
    return {s: tuple(round_like_paper(model_state_bytes(num_params, dp, s, **kwargs).device.total / GB)
                     for dp in dps) for s in STAGES}


def comm_volume(num_params: float, stage: int, *, num_microbatches: int = 1) -> float:
    """Elements each rank moves per optimizer step, as the paper counts them: 2, 2, 2, 3 Psi.

    With gradient accumulation over m micro-batches (the paper assumes m = 1): DDP (with
    no_sync) and stage 1 reduce once per step; stage 2 reduce-scatters every micro-batch's
    gradients, (m + 1) Psi, so as not to hold the full gradient; stage 3 gathers the
    parameters and reduce-scatters the gradients for every micro-batch, 3 m Psi.
    """
    _check(num_params, 1, stage)
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches!r}: give an int >= 1")
    m = num_microbatches
    collectives = {0: 2, 1: 2, 2: m + 1, 3: 3 * m}[stage]  # each moves Psi elements per rank
    return collectives * num_params


def comm_bytes_per_rank(num_params: float, stage: int, dp: int, bytes_per_element: float = 2, *,
                        num_microbatches: int = 1) -> float:
    """Bytes each rank sends per step under ring collectives: `comm_volume` x (N - 1)/N x bytes.

    Exact where the paper rounds: zero at dp = 1, 2 Psi (N-1)/N for DDP and stages 1 and 2,
    3 Psi (N-1)/N for stage 3. Equals `Ledger.bus_bytes()` for flat buffers of Psi elements.
    """
    _check(num_params, dp, stage, bytes_per_element=bytes_per_element)
    volume = comm_volume(num_params, stage, num_microbatches=num_microbatches)
    return volume * (dp - 1) / dp * bytes_per_element


def max_params_that_fit(device_bytes: float, dp: int, stage: int, *, host_bytes: float = math.inf,
                        disk_bytes: float = math.inf, **kwargs) -> int | float:
    """The largest Psi whose model states fit in `device_bytes` per device (and the per-rank
    host/disk limits when offloading); `kwargs` go to `model_state_bytes`. Model states only:
    leave room for activations. ``math.inf`` when nothing bounds it (all offloaded, no limit)."""
    per_param = model_state_bytes(1.0, dp, stage, **kwargs)  # bytes per parameter, per place
    limits = {"device": device_bytes, "host": host_bytes, "disk": disk_bytes}
    bad = {k: v for k, v in limits.items() if not (_number(v) or v == math.inf)}
    if bad:
        raise ValueError(f"{bad}: give limits in bytes >= 0 (math.inf for none)")
    fits = [limit / getattr(per_param, loc).total for loc, limit in limits.items()
            if getattr(per_param, loc).total > 0]
    best = min(fits, default=math.inf)
    return best if math.isinf(best) else math.floor(best)
