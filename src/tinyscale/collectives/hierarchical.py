"""Two-level (hierarchical) all-reduce: fast links inside a node, few bytes between nodes.

A cluster has fast links inside a node (NVLink, hundreds of GB/s) and slower ones between
nodes (InfiniBand, tens of GB/s per NIC). With G ranks per node and M nodes (n = G * M,
consecutive ranks on one node), the all-reduce is done in three phases:

    node 0: r0 r1          1. reduce-scatter inside each node (ring over G ranks):
    node 1: r2 r3             local rank l now holds the node's sum of shard l (1/G of it)
                           2. all-reduce shard l across nodes (ring over the M ranks with
      intra groups:           local rank l: the "inter" group {l, l+G, l+2G, ...})
        {r0 r1} {r2 r3}    3. all-gather inside each node: every rank has every shard
      inter groups:
        {r0 r2} {r1 r3}

Only phase 2 crosses nodes, and it carries 1/G of the message: each rank sends
2(M-1) * c2 * element_size bytes over the inter-node network, c1 = ceil(numel / G) (the
shard, padded) and c2 = ceil(c1 / M). The G inter-node rings run at once, one per local
rank, so a node with one NIC per GPU uses all of them. A flat ring over the same n ranks
crosses nodes at every node boundary, and each boundary rank sends 2(n-1) * ceil(numel/n)
elements across it, about 2x the message, on one NIC. Total per rank: 2(G-1) * c1 +
2(M-1) * c2 elements, in 2(G-1) + 2(M-1) rounds.

The groups: every rank must create *every* group, in the same order (group creation is a
collective over the world); a rank keeps the two it belongs to. `node_groups` does that.

Lesson: lessons/01-collectives.md. Tests: ``pytest tests/collectives -k hierarchical``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tinyscale.collectives.p2p import flat_view, group_ranks
from tinyscale.collectives.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter

# (id of the world group, world size, ranks per node) -> (intra group, inter group) of this
# rank. Creating groups is a collective over the world, and a long-lived process (a test
# worker, a training job) asks for the same ones many times.
_cache: dict[tuple[int, int, int], tuple[object, object]] = {}


def node_layout(world_size: int, ranks_per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """(intra groups, inter groups) as lists of global ranks: pure arithmetic, no processes.

    Node k holds ranks k*G .. k*G+G-1 (G = ranks_per_node); inter group l holds local rank
    l of every node: l, l+G, l+2G, ... Every rank is in exactly one group of each kind.
    """
    if ranks_per_node < 1 or world_size % ranks_per_node != 0:
        raise ValueError(
            f"node_layout: ranks_per_node={ranks_per_node} must be a positive divisor of the "
            f"world size {world_size}; choose one of "
            f"{[g for g in range(1, world_size + 1) if world_size % g == 0]}"
        )
    g, m = ranks_per_node, world_size // ranks_per_node
    intra = [[node * g + local for local in range(g)] for node in range(m)]
    inter = [[node * g + local for node in range(m)] for local in range(g)]
    return intra, inter


# --8<-- [start:node_groups]
def node_groups(ranks_per_node: int) -> tuple[object, object]:
    """(intra-node group, inter-node group) of this rank, for nodes of `ranks_per_node` ranks.

    Collective: call it on every rank of the world, in the same order as other group
    creation. Cached per (world, ranks_per_node).
    """
    world_size = dist.get_world_size()
    key = (id(dist.group.WORLD), world_size, ranks_per_node)
    if key not in _cache:
        intra_layout, inter_layout = node_layout(world_size, ranks_per_node)
        me = dist.get_rank()
        mine = {}
        # Every rank creates every group in the same order, members or not: new_group is a
        # collective over the world, and a rank that skipped one would leave the rest waiting.
        for kind, layout in (("intra", intra_layout), ("inter", inter_layout)):
            for ranks in layout:
                group = dist.new_group(ranks)
                if me in ranks:
                    mine[kind] = group
        _cache[key] = (mine["intra"], mine["inter"])
    return _cache[key]
# --8<-- [end:node_groups]


# --8<-- [start:hierarchical_all_reduce]
def hierarchical_all_reduce(tensor: torch.Tensor, *, intra_group, inter_group) -> torch.Tensor:
    """In place: `tensor` (any shape, contiguous) becomes the sum over all ranks of both groups.

    `intra_group`: this rank's node (G ranks); `inter_group`: the ranks with this rank's
    local position on every node (M ranks). Returns `tensor`.
    """
    flat = flat_view(tensor, "hierarchical_all_reduce")
    if flat.numel() == 0:
        return tensor
    shard = ring_reduce_scatter(flat, group=intra_group)  # (c1,): the node's sum of my shard
    ring_all_reduce(shard, group=inter_group)  # the only bytes that leave the node: 1/G
    node_size = len(group_ranks(intra_group))
    # Gather straight into `tensor` when no padding was needed; else into a G * c1 buffer.
    gathered = flat if flat.numel() == node_size * shard.numel() else flat.new_empty(node_size * shard.numel())
    ring_all_gather(gathered, shard, group=intra_group)
    if gathered is not flat:
        flat.copy_(gathered[: flat.numel()])
    return tensor
# --8<-- [end:hierarchical_all_reduce]


def hierarchical_all_reduce_world(tensor: torch.Tensor, group=None, *, ranks_per_node: int = 2) -> torch.Tensor:
    """`hierarchical_all_reduce` over the whole world, with nodes of `ranks_per_node` ranks.

    The ``fn(tensor, group=None)`` signature of the other algorithms, for `profile`; only
    the world group is supported (collective: creates the groups on first use).
    """
    if group is not None and group is not dist.group.WORLD:
        raise ValueError("hierarchical_all_reduce_world runs over the world group only; "
                         "build groups with node_groups and call hierarchical_all_reduce")
    intra, inter = node_groups(ranks_per_node)
    return hierarchical_all_reduce(tensor, intra_group=intra, inter_group=inter)
