"""tinyscale's one distributed runtime: launch ranks, arrange them in a mesh, count their bytes.

    ts.dist.launch(fn, world_size, *args)      # spawn ranks on this machine, results in rank order
    ts.dist.init()                             # or join a job started by torchrun
    ts.dist.ParallelMesh(dp=2, tp=2)           # the ranks as a (pp, dp, cp, tp) grid
    with ts.dist.comm.record() as ledger: ...  # every collective, with its bytes and time
"""

from tinyscale.dist import comm
from tinyscale.dist.launch import LaunchError, RankDiedError, RankError, RankTimeoutError, launch
from tinyscale.dist.log import get_logger, print0
from tinyscale.dist.mesh import DIMS, MeshLayout, ParallelMesh
from tinyscale.dist.runtime import RankInfo, device, info, init, rank, resolve_backend, world_size

__all__ = [
    "DIMS",
    "LaunchError",
    "MeshLayout",
    "ParallelMesh",
    "RankDiedError",
    "RankError",
    "RankInfo",
    "RankTimeoutError",
    "comm",
    "device",
    "get_logger",
    "info",
    "init",
    "launch",
    "print0",
    "rank",
    "resolve_backend",
    "world_size",
]
