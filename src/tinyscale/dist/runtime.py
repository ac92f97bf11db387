"""The process's place in the job: backend choice, process-group set-up, rank and device.

Two ways in:

* `tinyscale.dist.launch` spawns ranks on one machine and calls `init_rank` in each;
* under ``torchrun`` (one machine or many), call `init()`, which reads torchrun's
  environment variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and uses
  its rendezvous.

Either way the backend is chosen the same way: NCCL with ``cuda:local_rank`` when this
machine has at least as many GPUs as there are ranks on it, gloo on CPU otherwise.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

_device: torch.device = torch.device("cpu")


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


# --8<-- [start:resolve-backend]
def resolve_backend(backend: str, ranks_on_this_machine: int) -> str:
    """"auto" -> "nccl" if there is a GPU for every local rank, else "gloo"."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= ranks_on_this_machine else "gloo"
    if backend == "nccl" and gpus < ranks_on_this_machine:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: {ranks_on_this_machine} ranks on this "
            f"machine but {gpus} GPUs visible. Use backend='gloo' (CPU) or fewer ranks."
        )
    return backend
# --8<-- [end:resolve-backend]


def _cpu_threads_per_rank(ranks_on_this_machine: int) -> int:
    # N ranks each using every core thrash the machine (2 cores, 4 ranks: each torch op
    # would start 2 threads that fight 6 others). Share the cores out instead.
    return max(1, (os.cpu_count() or 1) // max(1, ranks_on_this_machine))


def init_rank(
    rank: int,
    world_size: int,
    *,
    local_rank: int,
    local_world_size: int,
    backend: str,
    timeout_s: float,
    store: dist.Store | None = None,
) -> RankInfo:
    """Create the default process group for this rank and pick its device.

    `timeout_s` becomes the process group's timeout: a collective that waits longer for a
    peer raises instead of hanging (torch's default is 30 minutes).
    """
    global _device
    backend = resolve_backend(backend, local_world_size)
    if backend == "nccl":
        _device = torch.device("cuda", local_rank)
        torch.cuda.set_device(_device)
    else:
        _device = torch.device("cpu")
        torch.set_num_threads(_cpu_threads_per_rank(local_world_size))
    kwargs = dict(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    if store is not None:
        kwargs["store"] = store
    if backend == "nccl":
        kwargs["device_id"] = _device
    dist.init_process_group(**kwargs)
    return RankInfo(rank, world_size, local_rank, backend, _device)


# --8<-- [start:init]
def init(backend: str = "auto", timeout_s: float = 600.0) -> RankInfo:
    """Join a job started by ``torchrun`` (reads its environment variables).

    Run as ``torchrun --nproc-per-node N your_script.py``; multi-node jobs use torchrun's
    rendezvous (``--nnodes``, ``--rdzv-endpoint``), not ours.
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"tinyscale.dist.init() is for processes started by torchrun, but {', '.join(missing)} "
            "is not set. Start with `torchrun --nproc-per-node N ...`, or use "
            "tinyscale.dist.launch(fn, world_size) to spawn ranks yourself."
        )
    if dist.is_initialized():
        return info()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return init_rank(
        rank,
        world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        backend=backend,
        timeout_s=timeout_s,
    )
# --8<-- [end:init]


def info() -> RankInfo:
    """This process's rank, world size, backend and device (a single process: rank 0 of 1)."""
    if not dist.is_initialized():
        return RankInfo(0, 1, 0, "none", _device)
    local_rank = int(os.environ.get("LOCAL_RANK", _device.index or 0))
    return RankInfo(dist.get_rank(), dist.get_world_size(), local_rank, dist.get_backend(), _device)


def device() -> torch.device:
    """The device this rank computes on: ``cuda:local_rank`` under NCCL, else CPU."""
    return _device


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
