"""Measure all-reduce algorithms over message sizes, the way nccl-tests reports them.

Run inside ranks (every rank calls it with the same arguments):

    rows = profile({"ring": "tinyscale.collectives.ring:ring_all_reduce",
                    "torch": "tinyscale.dist.comm:all_reduce"}, [1024, 1 << 20])
    alpha, beta = fit_alpha_beta(rows)

For each size: one warm-up call of each algorithm, then `repeats` rounds of one timed call
of each (interleaved, so that interference from other jobs is shared fairly). Before each
call the ranks meet at a barrier (so one rank's head start is not timed as another's
wait), and on a GPU the stream is synchronised before the clock starts and before it
stops: collectives are asynchronous there, and timing the launch alone reports absurd
bandwidths. A call takes as long as its slowest rank, so each repeat's time is the max
over ranks (one all-reduce of the timings, outside the clock); the row reports the
median over repeats, robust to the odd preempted run, and the fastest repeat: on a
machine shared with other jobs (or with more ranks than cores), a rank that waits is
put to sleep and may wake a time slice late, and the minimum is the closest to what the
algorithm costs without that.

Bandwidths, as nccl-tests defines them for all-reduce (size = the tensor's bytes):

    algbw = size / time                    what the caller sees
    busbw = algbw * 2(n-1)/n               what each link carried, if the algorithm were
                                           the ring: comparable with the hardware's link
                                           bandwidth and across n

Lesson: lessons/01-collectives.md (the measured-vs-model plot is made from these rows).
"""

from __future__ import annotations

import importlib
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from tinyscale.collectives.cost import COSTS
from tinyscale.dist import comm


def _resolve(spec: str | Callable) -> Callable:
    """A callable, or ``"package.module:name"`` imported."""
    if callable(spec):
        return spec
    module, _, name = spec.rpartition(":")
    return getattr(importlib.import_module(module), name)


def _synchronize(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


# --8<-- [start:profile]
def profile(algorithms: dict[str, str | Callable], sizes_bytes: list[int], *, dtype=torch.float32,
            repeats: int = 5, group=None) -> list[dict]:
    """One row per (size, algorithm): seconds (median of the per-repeat max over ranks), algbw, busbw.

    Also min_seconds, the fastest repeat.

    Each algorithm is called as ``fn(tensor, group=group)`` and must sum in place.
    The same rows come back on every rank.
    """
    fns = {name: _resolve(spec) for name, spec in algorithms.items()}
    n = dist.get_world_size(group)
    element_size = torch.tensor([], dtype=dtype).element_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    generator = torch.Generator().manual_seed(dist.get_rank())
    rows = []
    for size in sizes_bytes:
        numel = max(1, size // element_size)
        data = torch.randn(numel, generator=generator, dtype=torch.float64).to(device, dtype)
        x = torch.empty_like(data)
        times = {name: [] for name in fns}
        # Repeats outside, algorithms inside: a stretch of interference from other jobs then
        # hits every algorithm alike instead of all repeats of one.
        for i in range(1 + repeats):  # the first round warms up (buffers, connections)
            for name, fn in fns.items():
                x.copy_(data)  # the same input every time: sums stay O(n), never overflow
                _synchronize(x)
                comm.barrier(group)
                start = time.perf_counter()
                fn(x, group=group)
                _synchronize(x)
                if i > 0:
                    times[name].append(time.perf_counter() - start)
        for name in fns:
            slowest = torch.tensor(times[name], dtype=torch.float64, device=device)
            comm.all_reduce(slowest, op=comm.ReduceOp.MAX, group=group)
            seconds = statistics.median(slowest.tolist())
            nbytes = numel * element_size
            algbw = nbytes / seconds
            rows.append({"algorithm": name, "world_size": n, "bytes": nbytes, "numel": numel,
                         "element_size": element_size, "dtype": str(dtype).removeprefix("torch."),
                         "seconds": seconds, "min_seconds": min(slowest.tolist()),
                         "algbw": algbw, "busbw": algbw * 2 * (n - 1) / n,
                         "repeats": repeats})
    return rows
# --8<-- [end:profile]


# --8<-- [start:fit_alpha_beta]
def fit_alpha_beta(rows: list[dict], costs: dict[str, Callable] | None = None, *,
                   key: str = "seconds") -> tuple[float, float]:
    """Least-squares (alpha, beta) so that alpha_terms * alpha + beta_bytes * beta fits the rows.

    One pair for all the rows whose algorithm has a cost model (`COSTS` by default): the
    machine's latency and inverse bandwidth, if one alpha-beta model explains them all.
    The fit minimises *relative* error (each row weighted by 1 / its measured time), or the
    largest messages alone would decide it and alpha would be noise. `key` picks the
    timing to fit: "seconds" (the median) or "min_seconds".
    """
    costs = COSTS if costs is None else costs
    # Normal equations of min sum_i ((a*s_i + b*y_i - t_i) / t_i)^2, a 2x2 system.
    sss = ssy = syy = sst = syt = 0.0
    for row in rows:
        if row["algorithm"] not in costs:
            continue
        cost = costs[row["algorithm"]](row["numel"], row["element_size"], row["world_size"])
        s, y, t = cost.alpha_terms / row[key], cost.beta_bytes / row[key], 1.0
        sss, ssy, syy, sst, syt = sss + s * s, ssy + s * y, syy + y * y, sst + s * t, syt + y * t
    det = sss * syy - ssy * ssy
    if det == 0:
        raise ValueError("fit_alpha_beta: need rows of at least two different shapes (sizes or algorithms)")
    return (sst * syy - syt * ssy) / det, (sss * syt - ssy * sst) / det
# --8<-- [end:fit_alpha_beta]
