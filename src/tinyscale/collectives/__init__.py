"""All-reduce algorithms built from point-to-point messages, with their exact cost model.

Every algorithm here sums a tensor over a process group, in place, using nothing but
sends and receives through `tinyscale.dist.comm` (so a ledger sees every byte):

    algorithm                               file             rounds           bytes sent per rank
    naive_all_reduce                        naive.py         2                root (n-1)S, others S
    ring_all_reduce                         ring.py          2(n-1)           2(n-1)/n S (padded)
    recursive_halving_doubling_all_reduce   recursive.py     2 log2 n         2(n-1)/n S (padded)
    recursive_doubling_all_reduce           recursive.py     log2 n           log2 n * S
    tree_all_reduce                         tree.py          2 floor(log2 n)  S to 3S
    hierarchical_all_reduce                 hierarchical.py  2(G-1)+2(M-1)    2(G-1)/G S inside + 2(M-1)/M S/G across

(n = group size, S = the tensor's bytes, G ranks per node, M nodes; non-powers of two add
a fold, see recursive.py; exact per-rank figures with padding are in cost.py.) The pieces
of the ring on their own: `ring_reduce_scatter`, `ring_all_gather`.

Use it (inside ranks started by `tinyscale.dist.launch` or torchrun):

    from tinyscale.collectives import ring_all_reduce, ring_cost
    from tinyscale.dist import comm

    grad = torch.randn(1000)
    with comm.record() as ledger:
        ring_all_reduce(grad)                    # in place; group=None is the world
    n = dist.get_world_size()
    assert ledger.bytes("isend") == ring_cost(1000, 4, n).bytes_sent[dist.get_rank()]

The interface every all-reduce here follows (and a learner's version must, to run the
same tests through the seam `ALL_REDUCE`): ``fn(tensor, group=None)`` sums `tensor` (any
shape, contiguous, any numel including 0) over `group` in place, every rank ending with
the same bits, and returns it. Tests: ``pytest tests/collectives`` (``-k ring_allreduce``,
``-k tree_allreduce``, ...). Lesson: lessons/01-collectives.md.
"""

from tinyscale.collectives.cost import (
    COSTS,
    Cost,
    hierarchical_cost,
    hierarchical_phase_costs,
    measured_steps,
    naive_cost,
    recursive_doubling_cost,
    recursive_halving_doubling_cost,
    ring_all_gather_cost,
    ring_cost,
    ring_reduce_scatter_cost,
    tree_cost,
)
from tinyscale.collectives.hierarchical import (
    hierarchical_all_reduce,
    hierarchical_all_reduce_world,
    node_groups,
    node_layout,
)
from tinyscale.collectives.naive import naive_all_reduce
from tinyscale.collectives.p2p import exchange, group_ranks
from tinyscale.collectives.profile import fit_alpha_beta, profile
from tinyscale.collectives.recursive import recursive_doubling_all_reduce, recursive_halving_doubling_all_reduce
from tinyscale.collectives.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from tinyscale.collectives.tree import tree_all_reduce

# The seam: every all-reduce with the ``fn(tensor, group=None)`` interface, by name (the
# names of COSTS). Import strings, because test bodies resolve them inside rank processes.
ALL_REDUCE = {
    "naive": "tinyscale.collectives.naive:naive_all_reduce",
    "ring": "tinyscale.collectives.ring:ring_all_reduce",
    "recursive_halving_doubling": "tinyscale.collectives.recursive:recursive_halving_doubling_all_reduce",
    "recursive_doubling": "tinyscale.collectives.recursive:recursive_doubling_all_reduce",
    "tree": "tinyscale.collectives.tree:tree_all_reduce",
}

__all__ = [
    "ALL_REDUCE",
    "COSTS",
    "Cost",
    "exchange",
    "fit_alpha_beta",
    "group_ranks",
    "hierarchical_all_reduce",
    "hierarchical_all_reduce_world",
    "hierarchical_cost",
    "hierarchical_phase_costs",
    "measured_steps",
    "naive_all_reduce",
    "naive_cost",
    "node_groups",
    "node_layout",
    "profile",
    "recursive_doubling_all_reduce",
    "recursive_doubling_cost",
    "recursive_halving_doubling_all_reduce",
    "recursive_halving_doubling_cost",
    "ring_all_gather",
    "ring_all_gather_cost",
    "ring_all_reduce",
    "ring_cost",
    "ring_reduce_scatter",
    "ring_reduce_scatter_cost",
    "tree_all_reduce",
    "tree_cost",
]
