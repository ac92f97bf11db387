"""Rank functions for notebooks/01-collectives.ipynb (lesson 1, "Collectives").

Spawned ranks find a function by importing it, so everything the notebook runs on ranks
lives here, at module level (a function defined in a notebook cell cannot be imported).
Each runs on *every* rank with the same arguments; `tinyscale.dist.launch` returns the
values in rank order.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from tinyscale.collectives import (
    ALL_REDUCE,
    hierarchical_all_reduce,
    node_groups,
    profile,
    ring_all_reduce,
)
from tinyscale.dist import comm
from tinyscale.testing import resolve

TORCH = "tinyscale.dist.comm:all_reduce"
HIERARCHICAL = "tinyscale.collectives.hierarchical:hierarchical_all_reduce_world"


def _digest(t: torch.Tensor) -> str:
    """A hash of the tensor's bytes: equal digests on all ranks mean bitwise-equal results."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:12]


def check_algorithms(numels: list[int]) -> list[dict]:
    """Every algorithm on every size (float64): its error against torch's, its digest, its ledger rows."""
    rank, world = dist.get_rank(), dist.get_world_size()
    algorithms = dict(ALL_REDUCE)
    if world % 2 == 0 and world > 2:
        algorithms["hierarchical"] = HIERARCHICAL
    out = []
    for numel in numels:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
        expected = x.clone()
        comm.all_reduce(expected)  # torch's own (gloo), the reference
        for name, spec in algorithms.items():
            y = x.clone()
            with comm.record() as ledger:
                resolve(spec)(y)
            out.append({"algorithm": name, "numel": numel,
                        "max_abs_error": (y - expected).abs().max().item() if numel else 0.0,
                        "digest": _digest(y), "rows": ledger.rows})
    return out


def ring_trace(numel: int) -> list[dict]:
    """The ring all-reduce's messages as this rank's ledger saw them, one line per message."""
    with comm.record() as ledger:
        ring_all_reduce(torch.ones(numel))
    rounds, last = 0, None
    trace = []
    for row in ledger.rows:
        if row.start != last:  # rows of one exchange share their start time
            rounds, last = rounds + 1, row.start
        trace.append({"round": rounds, "op": row.op, "peer": row.peer, "bytes": row.bytes})
    return trace


def inter_node_bytes(numel: int, ranks_per_node: int) -> dict:
    """Bytes this rank sends to other "nodes", hierarchical vs flat ring, same float32 tensor."""
    node = dist.get_rank() // ranks_per_node
    intra, inter = node_groups(ranks_per_node)

    def crossing(rows):
        return sum(r.bytes for r in rows if r.op == "isend" and r.peer // ranks_per_node != node)

    with comm.record() as hier:
        hierarchical_all_reduce(torch.ones(numel), intra_group=intra, inter_group=inter)
    with comm.record() as flat:
        ring_all_reduce(torch.ones(numel))
    return {"hierarchical": crossing(hier.rows), "hierarchical_total": hier.bytes("isend"),
            "ring": crossing(flat.rows), "ring_total": flat.bytes("isend")}


def ring_and_nodes(trace_numel: int, numel: int, ranks_per_node: int) -> dict:
    """Both of the above in one launch (starting 4 ranks costs seconds on a small machine)."""
    return {"trace": ring_trace(trace_numel), "inter_node": inter_node_bytes(numel, ranks_per_node)}


def profile_algorithms(sizes: list[int], repeats: int) -> list[dict]:
    """`tinyscale.collectives.profile` over our algorithms and torch's own, float32."""
    algorithms = {"torch": TORCH, **ALL_REDUCE}
    if dist.get_world_size() % 2 == 0 and dist.get_world_size() > 2:
        algorithms["hierarchical"] = HIERARCHICAL
    return profile(algorithms, sizes, dtype=torch.float32, repeats=repeats)
