"""Rank functions for notebooks/00-setup.ipynb (lesson 0, "Setup: ranks on a laptop").

`tinyscale.dist.launch` starts every rank as a fresh process ("spawn"), and a fresh process
can only find a function by importing it: the notebook passes the rank a reference such as
``setup_ranks.whoami``, the rank imports this module and calls it. A function defined in a
notebook cell lives in the kernel's ``__main__`` and cannot be imported, so every function
that runs on ranks is here, at module level.

Each function below runs on *every* rank with the same arguments, and `launch` returns the
values in rank order. They are small on purpose; the notebook explains each one.
"""

from __future__ import annotations

import hashlib
import os
import time

import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.dist import comm
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import state_dict_cpu


def whoami() -> dict:
    """Where this rank is: its rank, the world, the backend, its process and the rendezvous."""
    me = ts.dist.info()
    comm.barrier()  # every rank has joined the same group before any of them leaves
    return {"rank": me.rank, "world_size": me.world_size, "local_rank": me.local_rank,
            "backend": me.backend, "device": str(me.device), "pid": os.getpid(),
            "MASTER_PORT": os.environ["MASTER_PORT"], "torch_threads": torch.get_num_threads()}


def meet() -> None:
    """The cheapest distributed task, one barrier: what a run costs beyond it is the machinery."""
    comm.barrier()


def all_reduce_ranks() -> tuple[list[float], list[float]]:
    """Rank r holds [r+1, r+1, r+1]; after a sum all-reduce every rank holds the same sum."""
    rank = dist.get_rank()
    t = torch.full((3,), float(rank + 1))
    before = t.tolist()
    comm.all_reduce(t)  # in place; blocks until every rank has contributed
    return before, t.tolist()


def ledger_rows(sizes: list[int]) -> list[dict]:
    """Issue a few collectives inside `comm.record()` and return what the ledger saw."""
    n = dist.get_world_size()
    with comm.record() as ledger:
        for numel in sizes:
            for dtype in (torch.float32, torch.float64):
                comm.all_reduce(torch.ones(numel, dtype=dtype))
        shard = torch.ones(sizes[0])
        comm.all_gather(torch.empty(n * sizes[0]), shard)  # output: n shards, rank order
        comm.reduce_scatter(torch.empty(sizes[0]), torch.ones(n * sizes[0]))  # output: 1/n of the input
    return [{"op": r.op, "dtype": r.dtype, "bytes": r.bytes, "group_size": r.group_size,
             "bus_bytes": r.bus_bytes, "ms": r.seconds * 1e3} for r in ledger.rows]


def digest(state: dict[str, torch.Tensor]) -> str:
    """A hash of every byte of a state dict: equal digests mean bitwise-equal tensors."""
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _gradients_times(model: torch.nn.Module, factor: float) -> None:
    """A realistic bug, injected without touching the engine: every gradient comes out
    `factor` times too large, exactly what a data-parallel all-reduce that sums over dp
    ranks and forgets to divide by dp produces (hooks on the parameters scale each
    gradient as autograd computes it, before any wrapper sees it)."""
    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(lambda grad: grad * factor)


def train_gpt(model_preset: str, dtype_name: str, config: dict, batches: list, seed: int = 0,
              bug: bool = False) -> dict:
    """Train the GPT with the engine on the given global batches; snapshot parameters every step.

    (`launch` passes positional arguments only, so `seed` and `bug` are positional too.)

    Every rank builds the same model from `seed` and sees the same list of global batches;
    the engine gives each rank its rows. Rank 0 returns the per-step losses and a parameter
    snapshot after every step; every rank returns the digest of its final parameters, so the
    caller can check that all ranks hold bitwise the same model. `bug=True` makes every
    gradient dp times too large (an all-reduce that forgot to divide by dp), to show what
    a real bug looks like next to rounding noise.
    """
    dtype = {"float32": torch.float32, "float64": torch.float64}[dtype_name]
    model = GPT(GPTConfig.preset(model_preset), seed=seed, dtype=dtype)
    if bug:
        _gradients_times(model, dist.get_world_size())
    engine = ts.initialize(model, config)
    losses, snapshots = [], []
    start = time.perf_counter()
    for batch in batches:
        losses.append(engine.train_batch(batch))
        if dist.get_rank() == 0:
            snapshots.append(state_dict_cpu(model))
    seconds = time.perf_counter() - start
    out = {"digest": digest(engine.full_state_dict()), "seconds": seconds}
    if dist.get_rank() == 0:
        out |= {"losses": losses, "snapshots": snapshots,
                "all_reduce_calls": engine.comm_ledger.calls("all_reduce"),
                "all_reduce_bytes": engine.comm_ledger.bytes("all_reduce")}
    return out


def fail_on_rank(bad_rank: int) -> None:
    """Rank `bad_rank` raises before the all-reduce; the others wait in it for a peer that never comes."""
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    comm.all_reduce(torch.ones(4))


def hang_on_rank(bad_rank: int) -> None:
    """Rank `bad_rank` never reaches the all-reduce (stuck in a long computation, say)."""
    if dist.get_rank() == bad_rank:
        time.sleep(3600)
    comm.all_reduce(torch.ones(4))


def skip_one_all_reduce(bad_rank: int, numels: list[int]) -> list[float]:
    """Every rank all-reduces tensors of the given sizes in turn, except that `bad_rank` skips the first.

    Used by the lesson's first exercise: collectives are matched by *order*, not by name.
    """
    rank = dist.get_rank()
    out = []
    for i, numel in enumerate(numels):
        if rank == bad_rank and i == 0:
            continue
        t = torch.full((numel,), float(i + 1))
        comm.all_reduce(t)
        out.append(t[0].item())
    return out
