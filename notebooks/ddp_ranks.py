"""Rank functions for notebooks/02-data-parallel.ipynb (lesson 2, "Data parallelism").

`tinyscale.dist.launch` starts every rank as a fresh process, and a fresh process finds a
function only by importing it, so everything that runs on ranks lives here, at module
level (a function defined in a notebook cell cannot be imported by a spawned rank).

Each function runs on *every* rank with the same arguments and `launch` returns the values
in rank order. What they measure:

- `comm_per_step`: what NaiveDDP and BucketedDDP send at construction and per step (ledger);
- `overlap_timeline`: when BucketedDDP launches each bucket, against the end of backward;
- `step_times`: step time of torch DDP, NaiveDDP and BucketedDDP (several bucket sizes),
  and the cost of one small and one large all-reduce;
- `train` (several runs per launch: `train_many`): a plain data-parallel training loop
  (accumulation under `no_sync`), with two classic bugs available as switches;
- `uneven_shards`, `unused_parameters` (both in one launch: `small_cases`): what the
  equal-rows assumption and `find_unused_parameters` are for.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tinyscale.config import OptimizerConfig
from tinyscale.data import local_micro_batches, synthetic_regression_batches, synthetic_token_batches
from tinyscale.data_parallel import BucketedDDP, NaiveDDP
from tinyscale.dist import comm
from tinyscale.models import GPT, GPTConfig, TinyMLP
from tinyscale.optim import build_optimizer
from tinyscale.testing import state_dict_cpu

WRAPPERS = {"naive": NaiveDDP, "bucketed": BucketedDDP, "torch": DistributedDataParallel}

OPTIMIZERS = {
    "sgd": {"type": "SGD", "params": {"lr": 5e-2, "momentum": 0.9}},
    "adamw": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    # L2 added to the gradient: torch's Adam(weight_decay=). A DeepSpeed-style "Adam" config decouples
    # the decay (AdamW) unless adam_w_mode is false, as DeepSpeed does; so it is said here.
    "adam_l2": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.01, "adam_w_mode": False}},
}


def wrap(impl: str, model: torch.nn.Module, bucket_cap_mb: float | None = None, **kwargs):
    """Wrap `model` in the named data-parallel implementation (NaiveDDP has no buckets)."""
    if bucket_cap_mb is not None and impl != "naive":
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    return WRAPPERS[impl](model, **kwargs)


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _gpt_batch(preset: str, rows: int, seed: int):
    cfg = GPTConfig.preset(preset)
    return synthetic_token_batches(num_batches=1, batch_size=rows, seq_len=cfg.max_seq_len, seed=seed)[0]


# ---------------------------------------------------------------------------------------------
# 1. What goes on the wire


def comm_per_step(variants: list[tuple[str, float | None]], preset: str = "small") -> list[dict]:
    """For each (impl, bucket_cap_mb): ledger of the constructor and of one backward."""
    out = []
    for impl, cap in variants:
        model = GPT(GPTConfig.preset(preset), seed=0)  # float32
        with comm.record() as construction:
            ddp = wrap(impl, model, cap)
        x, y = _gpt_batch(preset, 2, seed=dist.get_rank())
        with comm.record() as step:
            ddp(x, y).backward()
        out.append({
            "impl": impl, "bucket_cap_mb": cap,
            "init_calls": construction.calls("broadcast"), "init_bytes": construction.bytes("broadcast"),
            "step_calls": step.calls("all_reduce"), "step_bytes": step.bytes("all_reduce"),
            "step_bus_bytes": step.bus_bytes("all_reduce"),
            "grad_bytes": sum(p.numel() * p.element_size() for p in _trainable(model)),
            "param_tensors": len(_trainable(model)),
            "state_bytes": sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]),
            "state_tensors": len(list(model.parameters())) + len(list(model.buffers())),
            "buckets": [b.buffer.numel() * b.buffer.element_size() for b in getattr(ddp, "buckets", [])],
        })
    return out


# ---------------------------------------------------------------------------------------------
# 2. Overlap, seen from inside one backward


def overlap_timeline(bucket_cap_mb: float, steps: int, rows: int = 4, preset: str = "small") -> dict:
    """BucketedDDP with and without overlap, interleaved step by step on the same batches.

    Times are seconds from the end of forward (= the start of backward) on this rank:
    each bucket's launch (`events`), the end of autograd's backward (`backward_end`), when
    each bucket's wait() returned (ledger row `end`), and when backward() returned.
    """
    cfg = GPTConfig.preset(preset)
    x, y = _gpt_batch(preset, rows, seed=dist.get_rank())
    runs = {}
    for overlap in (True, False):
        model = GPT(cfg, seed=0)
        runs[overlap] = {"model": model, "ddp": BucketedDDP(model, bucket_cap_mb=bucket_cap_mb, overlap=overlap),
                         "steps": []}
    for _ in range(steps):
        for run in runs.values():
            dist.barrier()
            start = time.perf_counter()
            loss = run["ddp"](x, y)
            t0 = time.perf_counter()  # backward starts here
            with comm.record() as ledger:
                loss.backward()
            returned = time.perf_counter() - t0
            events = run["ddp"].events
            run["steps"].append({
                "forward": t0 - start,
                "launch": [(b, t - t0) for kind, b, t in events if kind == "launch"],
                "backward_end": next(t for kind, _, t in events if kind == "backward_end") - t0,
                "wait_returned": [r.end - t0 for r in ledger.rows if r.op == "all_reduce"],
                "returned": returned,
            })
            run["model"].zero_grad(set_to_none=True)
    buckets = [b.buffer.numel() * b.buffer.element_size() for b in runs[True]["ddp"].buckets]
    return {"buckets": buckets, "overlap": runs[True]["steps"], "no_overlap": runs[False]["steps"]}


# ---------------------------------------------------------------------------------------------
# 3. Step time


def _median_all_reduce(numel: int, reps: int) -> float:
    t = torch.zeros(numel)
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_times(variants: list[tuple[str, str, float | None, dict]], steps: int, rows: int = 4,
               preset: str = "small") -> dict:
    """Median step time (forward, backward with sync, AdamW step) of each (label, impl, cap, kwargs).

    Steps are interleaved round-robin over the variants, so that the machine's changing
    load hits every variant alike; the first two steps of each are warm-up and dropped.
    The label "compute only" runs the same step under no_sync (no communication at all).
    """
    cfg = GPTConfig.preset(preset)
    x, y = _gpt_batch(preset, rows, seed=dist.get_rank())
    runs = {}
    for label, impl, cap, kwargs in variants:
        model = GPT(cfg, seed=0)
        ddp = wrap(impl, model, cap, **kwargs)
        runs[label] = {"ddp": ddp, "opt": torch.optim.AdamW(model.parameters(), lr=1e-3), "times": [],
                       "context": ddp.no_sync if label == "compute only" else contextlib.nullcontext,
                       "calls": 0, "bucket_count": len(getattr(ddp, "buckets", []))}
    for _ in range(steps + 2):
        for run in runs.values():
            dist.barrier()
            with comm.record() as ledger:
                start = time.perf_counter()
                with run["context"]():
                    run["ddp"](x, y).backward()
                run["opt"].step()
                run["opt"].zero_grad(set_to_none=True)
                run["times"].append(time.perf_counter() - start)
            run["calls"] = ledger.calls("all_reduce")
    grad_numel = sum(p.numel() for p in GPT(cfg, seed=0).parameters())
    return {
        "median_s": {label: statistics.median(run["times"][2:]) for label, run in runs.items()},
        "times_s": {label: run["times"][2:] for label, run in runs.items()},
        "calls": {label: run["calls"] for label, run in runs.items()},
        "buckets": {label: run["bucket_count"] for label, run in runs.items()},
        "all_reduce_1_float_s": _median_all_reduce(1, 30),
        "all_reduce_grads_s": _median_all_reduce(grad_numel, 10),
        "grad_bytes": grad_numel * 4,
    }


# ---------------------------------------------------------------------------------------------
# 4. Training: equivalence, accumulation, and two classic bugs


def model_and_batches(kind: str, rows: int, steps: int, seed: int):
    """"mlp": TinyMLP (frozen, tied and reused parameters) on regression data; "gpt": the tiny
    GPT on synthetic tokens (16 per row). Both float64, both deterministic in `seed`."""
    if kind == "mlp":
        return TinyMLP(seed=seed), synthetic_regression_batches(num_batches=steps, batch_size=rows, dim=8, seed=seed)
    cfg = GPTConfig.preset("tiny")
    return (GPT(cfg, seed=seed, dtype=torch.float64),
            synthetic_token_batches(num_batches=steps, batch_size=rows, seq_len=16, seed=seed))


def train(impl: str, kind: str, *, micro: int, accum: int, steps: int, optimizer: str = "sgd",
          bucket_cap_mb: float | None = 1e-3, sync_last: bool = True, grad_factor: float = 1.0,
          seed: int = 0) -> dict:
    """The plain loop a DDP user writes: no_sync on all micro-batches but the last, then step.

    Two switches reproduce two classic bugs: ``sync_last=False`` keeps the last micro-batch
    inside no_sync too (gradients are never averaged), and ``grad_factor=N`` multiplies the
    synchronised gradients by N (what a DDP that sums and forgets to divide produces).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    model, batches = model_and_batches(kind, micro * accum * world, steps, seed)
    ddp = wrap(impl, model, bucket_cap_mb)
    opt = build_optimizer(_trainable(model), OptimizerConfig.model_validate(OPTIMIZERS[optimizer]))
    losses = []
    with comm.record() as ledger:
        for batch in batches:
            micros = local_micro_batches(batch, dp_rank=rank, dp_size=world, micro_batch_size=micro)
            total = torch.zeros((), dtype=torch.float64)
            for i, chunk in enumerate(micros):
                last = i == len(micros) - 1
                with contextlib.nullcontext() if (last and sync_last) else ddp.no_sync():
                    loss = ddp(*chunk)
                    (loss / len(micros)).backward()  # 1/accum: the mean over this rank's rows
                total += loss.detach().double()
            if grad_factor != 1.0:
                for p in _trainable(model):
                    p.grad.mul_(grad_factor)
            losses.append(total.item() / len(micros))  # this rank's mean; not all-reduced (not the DDP under test)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {"state": state_dict_cpu(model), "losses": losses, "all_reduce_calls": ledger.calls("all_reduce"),
            "all_reduce_bytes": ledger.bytes("all_reduce")}


def train_many(runs: list[tuple[str, str, dict]]) -> list[dict]:
    """`train(impl, kind, **kwargs)` for each (impl, kind, kwargs), in one launch (start-up costs seconds)."""
    return [train(impl, kind, **kwargs) for impl, kind, kwargs in runs]


# ---------------------------------------------------------------------------------------------
# 5. Uneven shards (heterogeneous GPUs) and unused parameters


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in _trainable(model)])


def uneven_shards(rows_per_rank: list[int], seed: int = 0) -> dict:
    """Each rank takes its share of one global batch; average the gradients two ways.

    plain:    all_reduce(g_r) / N                 (what DDP does: assumes equal rows)
    weighted: all_reduce(b_r * g_r) / all_reduce(b_r)   (each rank weighted by its rows)
    """
    rank = dist.get_rank()
    x, y = synthetic_regression_batches(num_batches=1, batch_size=sum(rows_per_rank), dim=8, seed=seed)[0]
    lo = sum(rows_per_rank[:rank])
    mine = slice(lo, lo + rows_per_rank[rank])
    model = TinyMLP(seed=seed)
    model(x[mine], y[mine]).backward()  # gradient of this rank's mean loss
    g = flat_grad(model)
    plain = g.clone()
    comm.all_reduce(plain)
    plain /= dist.get_world_size()
    rows = torch.tensor([float(rows_per_rank[rank])], dtype=torch.float64)
    weighted = g * rows
    comm.all_reduce(weighted)
    comm.all_reduce(rows)
    weighted /= rows
    return {"plain": plain, "weighted": weighted}


class TwoBranches(torch.nn.Module):
    """y = b(a(x)) or just a(x): a forward that can leave `b` unused (an MoE expert no token chose)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.b = torch.nn.Linear(4, 4, dtype=torch.float64)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        if use_b:
            h = self.b(h)
        return h.pow(2).mean()


def branch_batch(rank: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)


def unused_parameters(impl: str, find_unused: bool, unused_on: list[int], steps: int = 1) -> dict:
    """`b` is unused on the ranks in `unused_on`. Returns the gradients and what was sent."""
    rank = dist.get_rank()
    model = TwoBranches()
    ddp = wrap(impl, model, find_unused_parameters=find_unused)
    with comm.record() as ledger:
        for _ in range(steps):  # a second forward is where torch DDP notices the first went wrong
            model.zero_grad(set_to_none=True)
            ddp(branch_batch(rank), rank not in unused_on).backward()
    return {"grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            "rows": [(r.op, r.bytes, r.dtype) for r in ledger.rows]}


def small_cases(impls: list[str], rows_per_rank: list[int]) -> dict:
    """Two quick experiments in one launch: find_unused_parameters=True with `b` unused on
    rank 1 only, for each implementation; and `uneven_shards(rows_per_rank)`."""
    return {"unused": {impl: unused_parameters(impl, True, [1]) for impl in impls},
            "uneven": uneven_shards(rows_per_rank)}
