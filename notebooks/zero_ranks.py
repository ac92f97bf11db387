"""Rank functions for notebooks/03-zero.ipynb (lesson 3, "ZeRO").

`tinyscale.dist.launch` starts every rank as a fresh process, which finds a function only
by importing it, so everything that runs on ranks lives here, at module level. Each
function runs on every rank with the same arguments; `launch` returns the values in rank
order. What they measure:

- `states_and_traffic`: for ZeRO stages 0-3 through the engine, the bytes this rank holds
  by category (`engine.memory_report`), the bytes it put on the wire in one step (the comm
  ledger), and the parameters after training (to compare with the single-process reference);
- `stage3_timeline`: one stage-3 step seen from inside: `ZeroStage3.events` and the ledger's
  all-gathers, with and without prefetch, steps interleaved;
- `reduce_scatter_vs_all_reduce`: stage 1's gradient collective against the all-reduce it
  replaces, timed on the same buffer.

Starting ranks costs seconds (each imports torch), so the notebook runs several of these
per launch with `run_many`; `states_and_traffic` also runs in one process, without a
process group (a group of one: the same code path as N = 1).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.dist import comm
from tinyscale.models import GPT, GPTConfig

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}}


def engine_config(stage: int, world: int, micro: int = 1, accum: int = 1, bf16: bool = False) -> dict:
    config = {"train_batch_size": micro * accum * world, "train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": accum, "optimizer": ADAMW, "zero_optimization": {"stage": stage}}
    if bf16:  # the paper's accounting: bf16 parameters and gradients, fp32 master weights and Adam states
        config["bf16"] = {"enabled": True}
    return config


def model_and_batches(preset: str, rows: int, steps: int, seq_len: int, dtype=torch.float64, seed: int = 0):
    """The GPT preset in `dtype`, and `steps` global batches of `rows` rows of `seq_len` tokens."""
    cfg = GPTConfig.preset(preset)
    return (GPT(cfg, seed=seed, dtype=dtype),
            synthetic_token_batches(num_batches=steps, batch_size=rows, seq_len=seq_len, seed=seed))


def run_many(calls: list[tuple[str, tuple]]) -> list:
    """Run several of this module's functions in one launch: [(name, args)] -> [result]."""
    return [globals()[name](*args) for name, args in calls]


# ---------------------------------------------------------------------------------------------
# Memory and communication, stage by stage


def _step_traffic(ledger: comm.Ledger) -> dict:
    """{op: calls, bytes, bus bytes} of one step, without the loss's 8-byte all-reduce."""
    loss_row = [r for r in ledger.rows if r.op == "all_reduce"][-1]  # reduced after backward
    out: dict[str, dict] = {}
    for r in ledger.rows:
        if r is loss_row:
            continue
        s = out.setdefault(r.op, {"calls": 0, "bytes": 0, "bus_bytes": 0.0})
        s["calls"] += 1
        s["bytes"] += r.bytes
        s["bus_bytes"] += r.bus_bytes
    return out


def states_and_traffic(stages: list[int], preset: str = "small", steps: int = 2, accum: int = 1,
                       seq_len: int = 32, bf16: bool = False) -> dict:
    """Train `steps` steps per stage (AdamW, 1 row per micro-batch; float64, or with `bf16`
    a float32 model the engine runs in bf16 with fp32 master weights) and report:

    memory_report("before_step") of the last step (Adam creates its state in the first
    step, so the second step's snapshot holds everything), memory_report("now") after it,
    the last step's traffic, the losses, and the full parameters after training.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = {}
    for stage in stages:
        config = engine_config(stage, world, accum=accum, bf16=bf16)
        model, batches = model_and_batches(preset, world * accum, steps, seq_len,
                                           dtype=torch.float32 if bf16 else torch.float64)
        engine = ts.initialize(model, config)
        losses = []
        for batch in batches:
            engine.comm_ledger.clear()  # keep one step (the construction broadcast goes first)
            losses.append(engine.train_batch(batch))
        state = engine.full_state_dict()  # every rank: stage 3 all-gathers for it
        out[stage] = {
            "before_step": engine.memory_report("before_step").as_dict(),
            "between_steps": engine.memory_report("now").as_dict(),
            "traffic": _step_traffic(engine.comm_ledger) if world > 1 else {},
            "losses": losses,
            "state": state if rank == 0 else None,
        }
    return out


# ---------------------------------------------------------------------------------------------
# Stage 3 from inside one step


def stage3_timeline(steps: int, preset: str = "small", rows: int = 4, seq_len: int = 128) -> dict:
    """Two stage-3 engines over the same float32 model and batches, prefetch on and off,
    stepped alternately. Per step: `ZeroStage3.events` (kind, unit, seconds from the step's
    start), the all-gathers from the ledger (start and end = when wait() returned), and the
    step time. Also each unit's gathered bytes and name."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = GPTConfig.preset(preset)
    batches = synthetic_token_batches(num_batches=steps, batch_size=rows * world, seq_len=seq_len, seed=0)
    engines = {}
    for prefetch in (True, False):
        engine = ts.initialize(GPT(cfg, seed=0), engine_config(3, world, micro=rows))
        engine.zero.prefetch = prefetch  # ZeroStage3's switch; the engine always prefetches
        engines[prefetch] = engine
    zero = engines[True].zero
    names = {id(m): n for n, m in engines[True].model.named_modules()}
    units = [{"name": names[id(unit.module)] or "root (embed, norm, head)",
              "bytes": sum(zero.full[i].numel() * zero.full[i].element_size() for i in unit.flats)}
             for unit in zero.units]
    runs = {True: [], False: []}
    for batch in batches:
        for prefetch, engine in engines.items():
            dist.barrier()
            engine.comm_ledger.clear()
            start = time.perf_counter()
            engine.train_batch(batch)
            elapsed = time.perf_counter() - start
            gathers = [(r.start - start, r.end - start) for r in engine.comm_ledger.rows if r.op == "all_gather"]
            runs[prefetch].append({"step": elapsed, "gathers": gathers,
                                   "events": [(k, u, t - start) for k, u, t in engine.zero.events]})
    return {"units": units, "root": zero.root, "prefetch": runs[True], "no_prefetch": runs[False],
            "rank": rank}


# ---------------------------------------------------------------------------------------------
# Stage 1's collective


def reduce_scatter_vs_all_reduce(numel: int, reps: int = 15) -> dict:
    """Median time and ledger bus bytes of an all-reduce and of a reduce-scatter of the
    same float32 buffer (what stage 1 sends, against what DDP sends), interleaved."""
    world = dist.get_world_size()
    numel = -(-numel // world) * world  # padded to a multiple of N, as a FlatUnit is
    flat = torch.randn(numel)
    shard = torch.empty(numel // world)
    times: dict[str, list[float]] = {"all_reduce": [], "reduce_scatter": [], "all_gather": []}
    bus: dict[str, float] = {}
    for _ in range(reps):
        for op, samples in times.items():
            dist.barrier()
            with comm.record() as ledger:
                start = time.perf_counter()
                if op == "all_reduce":
                    comm.all_reduce(flat)
                elif op == "reduce_scatter":
                    comm.reduce_scatter(shard, flat)
                else:
                    comm.all_gather(flat, shard)
                samples.append(time.perf_counter() - start)
            bus[op] = ledger.bus_bytes()
    return {"numel": numel, "median_s": {op: statistics.median(t) for op, t in times.items()}, "bus_bytes": bus}
