"""DeepSpeed's engine and tinyscale's, side by side on the same ranks: the same GPT, config and rows.

Runs inside `tinyscale.testing.deepspeed_peer` (``train`` task), never in a test process:
`train(payload)` launches `world_size` gloo ranks (`tinyscale.dist.launch`); each builds the GPT
from the same seed, and for each ZeRO stage asked for trains it once through
``deepspeed.initialize`` (``engine(x, y)``, ``engine.backward(loss)``, ``engine.step()`` per
micro-batch) and once through ``tinyscale.initialize`` (``train_batch``), optionally alternating
step by step (``interleave``, for timing), and returns the losses, the final full parameters,
the seconds of every step (its slowest rank's) and the CPU seconds every step cost, summed over
the ranks (each rank process's user + system time, all its threads: gloo's included). On a
machine with fewer free cores than threads a step's wall time is about its CPU work, and the CPU
seconds are the load-robust part of it.

Rows as tinyscale's engine splits them (`tinyscale.data.local_micro_batches`): rank r takes
the r-th contiguous block of each global batch, cut into contiguous micro-batches. DeepSpeed's
loss per step is the mean of its micro-batch losses averaged over ranks, as tinyscale reports.
The optimizer is the config's: ``SGD`` (given to DeepSpeed as a torch optimizer, which needs
``zero_allow_untested_optimizer``, as DeepSpeed's config has no SGD) or ``AdamW`` with
``torch_adam: true`` (torch's AdamW on both sides).
"""

from __future__ import annotations

import copy
import resource
import time

import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def _deepspeed_engine(model, config: dict):
    import deepspeed

    ds_config = copy.deepcopy(config)
    opt = ds_config.get("optimizer", {})
    optimizer = None
    if opt.get("type") == "SGD":  # not a DeepSpeed optimizer type: hand it torch's
        ds_config.pop("optimizer")
        p = opt.get("params", {})
        optimizer = torch.optim.SGD(model.parameters(), lr=p["lr"], momentum=p.get("momentum", 0.0),
                                    weight_decay=p.get("weight_decay", 0.0))
        ds_config["zero_allow_untested_optimizer"] = True
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=model.parameters(),
                                      config=ds_config)
    return engine


def _full_parameters(engine, stage: int) -> dict:
    import deepspeed

    params = dict(engine.module.named_parameters())
    if stage == 3:  # each rank holds a shard: gather them for reading
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {k: v.detach().clone().tolist() for k, v in params.items()}
    return {k: v.detach().clone().tolist() for k, v in params.items()}


def _deepspeed_step(engine, batch, rank: int, world: int, gas: int) -> float:
    import torch.distributed as dist

    from tinyscale.data import local_micro_batches

    total = 0.0
    micro_rows = batch[0].shape[0] // (world * gas)
    for micro in local_micro_batches(batch, dp_rank=rank, dp_size=world, micro_batch_size=micro_rows):
        loss = engine(*micro)
        engine.backward(loss)
        engine.step()  # steps the optimizer only at the accumulation boundary
        total += loss.detach().double().item()
    mean = torch.tensor(total / gas, dtype=torch.float64)
    dist.all_reduce(mean)
    return mean.item() / world


def _rank(payload: dict) -> dict:
    import deepspeed
    import torch.distributed as dist

    import tinyscale as ts
    from tinyscale.bench import slowest
    from tinyscale.models import GPT, GPTConfig

    from tinyscale.testing.deepspeed_peer import skip_shm_op

    skip_shm_op()  # an inference-only op: training's collectives are torch.distributed's either way
    deepspeed.init_distributed(dist_backend="gloo")  # wraps the group launch made
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[payload.get("dtype", "float64")]
    torch.set_num_threads(payload.get("threads", 1))
    cfg = GPTConfig(**payload["model"])
    batches = [tuple(torch.tensor(t) for t in b) for b in payload["batches"]]
    gas = payload["config"].get("gradient_accumulation_steps", 1)
    out = {}
    for stage in payload["stages"]:
        config = copy.deepcopy(payload["config"])
        config.setdefault("zero_optimization", {})["stage"] = stage
        runs = {}
        engines = {}
        for side in payload.get("sides", ["deepspeed", "tinyscale"]):
            model = GPT(cfg, seed=payload["seed"], dtype=dtype)
            engines[side] = _deepspeed_engine(model, config) if side == "deepspeed" else ts.initialize(model, config)
            runs[side] = {"losses": [], "seconds": [], "cpu_seconds": []}
        order = list(engines)
        if payload.get("interleave"):  # for timing: step by step, alternating who goes first
            for step, batch in enumerate(batches):
                for side in order if step % 2 == 0 else order[::-1]:
                    runs[side]["losses"].append(_one(engines[side], side, batch, rank, world, gas, runs[side]))
        else:
            resize = "batch_sizes" in payload  # batches of other sizes: set_train_batch_size on both engines
            for side in order:
                for batch in batches:
                    runs[side]["losses"].append(_one(engines[side], side, batch, rank, world, gas, runs[side],
                                                     resize))
        # a step ends when every rank's does: each step's slowest rank (rank 0 alone would leave
        # out tinyscale's optimizer step on the other ranks, which DeepSpeed's loss all-reduce waits for)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, {side: (runs[side]["seconds"], runs[side]["cpu_seconds"]) for side in runs})
        for side in runs:
            runs[side]["seconds"] = slowest([r[side][0] for r in per_rank])
            runs[side]["cpu_seconds"] = [sum(step) for step in zip(*(r[side][1] for r in per_rank))]
        for side, engine in engines.items():
            full = _full_parameters(engine, stage) if side == "deepspeed" else {
                k: v.tolist() for k, v in engine.full_state_dict().items()}
            if payload.get("parameters", True):
                runs[side]["parameters"] = full
        out[str(stage)] = runs
    return out if rank == 0 else {}


def _one(engine, side, batch, rank, world, gas, run, resize: bool = False) -> float:
    import torch.distributed as dist

    if resize:  # DeepSpeed's set_train_batch_size (tinyscale's: engine/batch_change.py) before the step
        rows = batch[0].shape[0]
        if rows != (engine.train_batch_size() if side == "deepspeed" else engine.batch.train_batch_size):
            engine.set_train_batch_size(rows)
        gas = engine.gradient_accumulation_steps() if side == "deepspeed" else gas
        run.setdefault("accumulation", []).append(
            gas if side == "deepspeed" else engine.batch.gradient_accumulation_steps)

    dist.barrier()
    cpu, start = _cpu_seconds(), time.perf_counter()
    loss = _deepspeed_step(engine, batch, rank, world, gas) if side == "deepspeed" else engine.train_batch(batch)
    run["seconds"].append(time.perf_counter() - start)
    run["cpu_seconds"].append(_cpu_seconds() - cpu)
    return float(loss)


def _cpu_seconds() -> float:
    """This process's CPU time so far, every thread (the main one and gloo's), user + system."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def train(payload: dict) -> dict:
    from tinyscale.dist import launch

    return launch(_rank, payload["world_size"], payload, timeout_s=payload.get("timeout_s", 600))[0]
