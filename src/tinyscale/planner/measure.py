"""The machine at hand, measured for the planner: matmul peak, the gloo link, the host's overhead.

    m = run_on_ranks(measure_machine, 2, model_config)[0]   # on every rank (it all-reduces)
    cluster = cpu_cluster(2, m)                            # what `tinyscale autotune` plans with

- peak: `tinyscale.mfu.measured_peak` (the fastest square matmul in half a second);
- the link: the fastest of 5 all-reduces of 2 floats (on 2 ranks a ring all-reduce costs
  2 alpha, and about as much on more: alpha = t_small / 2) and of 2^20 floats (4 MiB: beta =
  bytes / (t_big - t_small));
- the host overhead: one token through the model, forward and backward (nothing to compute):
  the time per layer of the 3 passes, what a small micro-batch cannot amortise.

Each is the best of a few tries: on a machine shared with other work the slower tries measure
the neighbours. CPU ranks share their cores between gloo and the matmuls, so the cluster
overlaps nothing. The planner's ranking test (`pytest -k planner --thorough`) and `tinyscale
autotune` both plan with these. Tests: `pytest -k autotune`.
"""

from __future__ import annotations

import math
import time

import torch

from tinyscale.planner.cluster import Cluster, Link

MEASURED_KEYS = ("peak", "alpha", "beta", "launch")


def link_alpha_beta(big: int = 1 << 20, tries: int = 5) -> tuple[float, float]:
    """(alpha in seconds, beta in bytes/s) of the default group's all-reduce (collective)."""
    import torch.distributed as dist

    def best_s(n: int) -> float:
        x, best = torch.zeros(n), float("inf")
        for _ in range(tries):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            best = min(best, time.perf_counter() - start)
        return best

    small, large = best_s(2), best_s(big)
    return small / 2, 4 * big / max(large - small, 1e-9)


def host_overhead_s(model_config, tries: int = 5) -> float:
    """Seconds of host work per layer per pass: one token through `model_config`'s GPT, forward
    and backward (counted as 3 passes over n_layer + 1 units, the head included)."""
    from tinyscale.models import GPT

    model, idx, best = GPT(model_config, seed=1), torch.zeros(1, 1, dtype=torch.long), float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        model(idx, idx).backward()
        best = min(best, (time.perf_counter() - start) / (3 * (model_config.n_layer + 1)))
    return best


def measure_machine(model_config, peak_seconds: float = 0.5) -> dict:
    """On every rank (collective): {"peak": FLOP/s, "alpha": s, "beta": bytes/s, "launch": s}."""
    from tinyscale.mfu import measured_peak

    peak = measured_peak("cpu", torch.float32, max_seconds=peak_seconds)
    alpha, beta = link_alpha_beta()
    return {"peak": peak, "alpha": alpha, "beta": beta, "launch": host_overhead_s(model_config)}


def cpu_cluster(world: int, m: dict) -> Cluster:
    """`world` CPU ranks on one machine as the planner sees them, from `measure_machine`'s dict.
    Memory is no limit (1 TB); efficiency 1: the peak is already what a matmul reaches."""
    for key in MEASURED_KEYS:
        if not (isinstance(m.get(key), int | float) and math.isfinite(m[key]) and m[key] > 0):
            raise ValueError(f"{key}={m.get(key)!r}: a measured or given value must be a finite number > 0")
    return Cluster(gpus=world, gpus_per_node=world, gpu_mem=1e12, peak_flops=m["peak"], efficiency=1.0,
                   intra=Link(m["alpha"], m["beta"]), hbm_bw=10e9, overlap=False, launch_overhead=m["launch"],
                   name="cpu ranks (measured)")


def describe(m: dict, given: set[str] = frozenset()) -> str:
    """One line for the user: what was measured and what was given."""
    def src(key: str) -> str:
        return "given" if key in given else "measured"
    return (f"matmul peak {m['peak'] / 1e9:.1f} GFLOP/s ({src('peak')}), all-reduce alpha "
            f"{m['alpha'] * 1e6:.0f} us ({src('alpha')}), beta {m['beta'] / 1e9:.2f} GB/s ({src('beta')}), "
            f"host {m['launch'] * 1e3:.3f} ms per layer ({src('launch')})")
