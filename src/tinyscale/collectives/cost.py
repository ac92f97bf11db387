"""The alpha-beta cost model of each all-reduce, exact to the byte for our implementations.

A message of m bytes costs alpha + m * beta: alpha is the latency (software, wire, a
kernel launch), 1/beta the bandwidth. An algorithm is a sequence of rounds, and a rank's
link carries one message at a time (the "single-port" model), so a round costs alpha and
beta per message and per byte through its busiest link. The textbook figures, for n ranks
and a message of S bytes (n a power of two where it matters):

    algorithm                    rounds     bytes sent per rank       time
    naive (root)                 2          root (n-1) S, others S    2(n-1) (alpha + S beta)
    ring                         2(n-1)     2(n-1)/n S                2(n-1) alpha + 2(n-1)/n S beta
    recursive halving/doubling   2 log2 n   2(n-1)/n S                2 log2 n alpha + 2(n-1)/n S beta
    recursive doubling           log2 n     log2 n * S                log2 n (alpha + S beta)
    binary tree                  2 log2 n   S, 2S or 3S               2 log2 n (alpha + S beta) [1]

[1] the textbook's tree passes one message per link per round (a binomial tree does).
    In our binary tree a parent takes both children's messages in one round, through
    one link: 2(alpha + S beta) per level and phase, about 4 log2 n (alpha + S beta).

"Rounds" are what a rank waits on in sequence (the naive root posts its n-1 receives in
one round, and the ledger sees one); "time" charges the messages through one link one
after the other. `Cost` keeps both: `steps` (rounds, measurable from the ledger) and
`alpha_terms` (latencies paid in sequence, the model).

**Why 2(n-1)/n S is the best any algorithm can do.** For one element, think of each
rank's input as a rumour that must reach every rank (the sum needs every input).
Until the first rank knows all n inputs, n-1 messages are needed (n inputs on n ranks
merge one message at a time); after that, each of the other n-1 ranks still needs a
message of its own to complete. So every element crosses a link at least 2(n-1) times
(the one-way gossip bound), 2(n-1) S bytes in all; shared by n senders, some rank sends
at least 2(n-1)/n S, and the ring sends exactly that on every rank. With one message per
link per round, fewer than log2 n latencies is impossible too (what a rank knows at most
doubles per round), which recursive doubling meets.

**When the ring loses.** Its 2(n-1) alpha grows with n. For small messages the latency
term dominates, and recursive doubling (log2 n rounds) or a tree wins; the crossover
message size is where the alpha saved equals the beta added. Recursive halving/doubling
has the ring's bytes with the tree's rounds; real networks still favour the ring for
large messages, because its traffic is neighbour-to-neighbour and pipelines, while
distant partners contend for shared links. (A third term, gamma per byte reduced, is the
cost of the additions; it is small on GPUs and folded into beta here.)

**What our implementations send, exactly** (m = numel, s = element size, n = group size;
nothing at all when m == 0 or n == 1):

* ring: chunks of c = ceil(m/n) elements; the tensor is zero-padded to n*c and the
  padding travels: 2(n-1) * c * s bytes per rank, = 2(n-1)/n of the padded payload n*c*s.
* recursive halving/doubling: p = 2^floor(log2 n), r = n - p; padded to p * c,
  c = ceil(m/p): core ranks send 2(p-1) * c * s; the r partners of extra ranks also send
  m*s back; the r extra ranks send only m*s (the fold is unpadded).
* recursive doubling: core ranks log2(p) * m * s, partners + m*s, extra ranks m*s.
* naive: root (n-1) * m * s, others m * s.
* tree: position i sends m*s to its parent (i > 0) and m*s to each of its 0-2 children.
* hierarchical: 2(G-1) * c1 * s + 2(M-1) * c2 * s, c1 = ceil(m/G), c2 = ceil(c1/M).

"Sent" is what the ledger calls ``isend`` (plus ``send``); each rank receives as much
in total as it sends in the ring and recursive halving/doubling, not in the others.
Lesson: lessons/01-collectives.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tinyscale.collectives.recursive import largest_power_of_two
from tinyscale.collectives.tree import heap_children


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --8<-- [start:cost]
@dataclass(frozen=True)
class Cost:
    """What one all-reduce costs, in the alpha-beta model.

    steps:         rounds on the critical path: exchanges waited on in sequence (measured
                   from the ledger by `measured_steps`)
    bytes_sent:    exact bytes each rank sends, by position in the group (the ledger's isend)
    alpha_terms:   latencies paid in sequence: summed over rounds, the most messages
                   through one rank's link (equal to `steps` when each rank exchanges
                   with one partner per round)
    beta_bytes:    bytes that pay beta: summed over rounds, the most bytes through one link
    """

    steps: int
    bytes_sent: tuple[int, ...]
    alpha_terms: int
    beta_bytes: int

    @property
    def max_bytes_sent(self) -> int:
        return max(self.bytes_sent, default=0)

    def predicted_seconds(self, alpha: float, beta: float) -> float:
        """alpha seconds per latency plus beta seconds per byte on the critical path."""
        return self.alpha_terms * alpha + self.beta_bytes * beta

    def __add__(self, other: Cost) -> Cost:
        """The cost of running `self`, then `other`, on the same ranks."""
        if len(self.bytes_sent) != len(other.bytes_sent):
            raise ValueError(f"cannot add costs over {len(self.bytes_sent)} and {len(other.bytes_sent)} ranks")
        bytes_sent = tuple(a + b for a, b in zip(self.bytes_sent, other.bytes_sent))
        return Cost(self.steps + other.steps, bytes_sent, self.alpha_terms + other.alpha_terms,
                    self.beta_bytes + other.beta_bytes)

    @staticmethod
    def nothing(world_size: int) -> Cost:
        return Cost(0, (0,) * world_size, 0, 0)
# --8<-- [end:cost]


def naive_cost(numel: int, element_size: int, world_size: int) -> Cost:
    n, msg = world_size, numel * element_size
    if numel == 0 or n == 1:
        return Cost.nothing(n)
    # Round 1 all n-1 messages go into the root's link, round 2 all come out of it.
    return Cost(2, ((n - 1) * msg,) + (msg,) * (n - 1), 2 * (n - 1), 2 * (n - 1) * msg)


# --8<-- [start:ring_cost]
def ring_reduce_scatter_cost(numel: int, element_size: int, world_size: int) -> Cost:
    """`numel`: the whole input; chunks of ceil(numel / n) elements (padding included)."""
    n, chunk = world_size, _ceil_div(numel, world_size) * element_size
    if numel == 0 or n == 1:
        return Cost.nothing(n)
    return Cost(n - 1, ((n - 1) * chunk,) * n, n - 1, (n - 1) * chunk)


def ring_all_gather_cost(numel: int, element_size: int, world_size: int) -> Cost:
    """`numel`: one rank's input (the output has world_size times as many)."""
    n, chunk = world_size, numel * element_size
    if numel == 0 or n == 1:
        return Cost.nothing(n)
    return Cost(n - 1, ((n - 1) * chunk,) * n, n - 1, (n - 1) * chunk)


def ring_cost(numel: int, element_size: int, world_size: int) -> Cost:
    chunk_numel = _ceil_div(numel, world_size)
    return (ring_reduce_scatter_cost(numel, element_size, world_size)
            + ring_all_gather_cost(chunk_numel, element_size, world_size))
# --8<-- [end:ring_cost]


def recursive_halving_doubling_cost(numel: int, element_size: int, world_size: int) -> Cost:
    n, msg = world_size, numel * element_size
    if numel == 0 or n == 1:
        return Cost.nothing(n)
    p = largest_power_of_two(n)
    r = n - p
    core = 2 * (p - 1) * _ceil_div(numel, p) * element_size  # halving + doubling, padded
    sent = tuple(core + (msg if i < r else 0) for i in range(p)) + (msg,) * r
    fold = 2 if r else 0  # one round in, one round out
    rounds = 2 * (p.bit_length() - 1) + fold
    return Cost(rounds, sent, rounds, core + fold * msg)


def recursive_doubling_cost(numel: int, element_size: int, world_size: int) -> Cost:
    n, msg = world_size, numel * element_size
    if numel == 0 or n == 1:
        return Cost.nothing(n)
    p = largest_power_of_two(n)
    r, rounds = n - p, p.bit_length() - 1
    sent = tuple(rounds * msg + (msg if i < r else 0) for i in range(p)) + (msg,) * r
    fold = 2 if r else 0
    return Cost(rounds + fold, sent, rounds + fold, (rounds + fold) * msg)


def tree_cost(numel: int, element_size: int, world_size: int) -> Cost:
    n, msg = world_size, numel * element_size
    if numel == 0 or n == 1:
        return Cost.nothing(n)
    depth = [(i + 1).bit_length() - 1 for i in range(n)]  # heap depth of position i
    sent = tuple((msg if i > 0 else 0) + len(heap_children(i, n)) * msg for i in range(n))
    # Each level is one round up and one round down; its busiest link is a parent with
    # the most children at that level (1 or 2 messages through one link).
    busiest = [max(len(heap_children(i, n)) for i in range(n) if depth[i] == d) for d in range(depth[-1])]
    return Cost(2 * depth[-1], sent, 2 * sum(busiest), 2 * sum(busiest) * msg)


def hierarchical_phase_costs(numel: int, element_size: int, world_size: int, ranks_per_node: int = 2
                             ) -> dict[str, Cost]:
    """The three phases, each over its own group (positions within that group)."""
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide the world size {world_size}")
    g, m = ranks_per_node, world_size // ranks_per_node
    shard = _ceil_div(numel, g)
    return {
        "intra_reduce_scatter": ring_reduce_scatter_cost(numel, element_size, g),
        "inter_all_reduce": ring_cost(shard, element_size, m),
        "intra_all_gather": ring_all_gather_cost(shard, element_size, g),
    }


def hierarchical_cost(numel: int, element_size: int, world_size: int, ranks_per_node: int = 2) -> Cost:
    """The whole two-level all-reduce, bytes by global rank (node k holds ranks k*G .. k*G+G-1)."""
    phases = hierarchical_phase_costs(numel, element_size, world_size, ranks_per_node)
    rs, inter, ag = phases.values()
    g = ranks_per_node
    sent = tuple(rs.bytes_sent[r % g] + inter.bytes_sent[r // g] + ag.bytes_sent[r % g]
                 for r in range(world_size))
    return Cost(rs.steps + inter.steps + ag.steps, sent, rs.alpha_terms + inter.alpha_terms + ag.alpha_terms,
                rs.beta_bytes + inter.beta_bytes + ag.beta_bytes)


# The cost model of each algorithm, by the names of tinyscale.collectives.ALL_REDUCE.
COSTS = {
    "naive": naive_cost,
    "ring": ring_cost,
    "recursive_halving_doubling": recursive_halving_doubling_cost,
    "recursive_doubling": recursive_doubling_cost,
    "tree": tree_cost,
    "hierarchical": hierarchical_cost,
}


_P2P_OPS = {"isend": "send", "send": "send", "irecv": "recv", "recv": "recv"}


# --8<-- [start:measured_steps]
def measured_steps(rows_by_rank: Sequence[Sequence]) -> int:
    """Rounds on the critical path of a recorded run: `rows_by_rank[g]` is global rank g's ledger rows.

    A round of one rank is one `exchange` (rows that share a start time). The k-th message
    from rank a to rank b is matched with b's k-th receive from a. A message can go once
    both its sender and its receiver have finished their previous round, so its round is
    1 + the later of those two; a rank's round is its latest message's. The answer is
    the latest round of all: how many latencies (alphas) the run paid in sequence.
    """
    batches = []  # batches[g] = list of lists of (kind, peer)
    for rows in rows_by_rank:
        mine, last_start = [], None
        for row in rows:
            if row.op not in _P2P_OPS:
                continue
            if not mine or not row.async_op or row.start != last_start:
                mine.append([])
            mine[-1].append((_P2P_OPS[row.op], row.peer))
            last_start = row.start if row.async_op else None
        batches.append(mine)
    sends, recvs = {}, {}  # (src, dst) -> [batch index at src] / [batch index at dst]
    for rank, mine in enumerate(batches):
        for b, batch in enumerate(mine):
            for kind, peer in batch:
                if kind == "send":
                    sends.setdefault((rank, peer), []).append(b)
                else:
                    recvs.setdefault((peer, rank), []).append(b)
    if {k: len(v) for k, v in sends.items()} != {k: len(v) for k, v in recvs.items()}:
        raise ValueError("measured_steps: the sends and receives in these ledgers do not match up")
    messages = [(src, bs, dst, br) for (src, dst), bss in sends.items()
                for bs, br in zip(bss, recvs[(src, dst)])]
    rounds = [[0] * len(mine) for mine in batches]
    before = lambda rank, b: rounds[rank][b - 1] if b > 0 else 0  # noqa: E731
    for _ in range(len(messages) + 1):  # a longest-path relaxation: settles within |messages| passes
        changed = False
        for src, bs, dst, br in messages:
            r = 1 + max(before(src, bs), before(dst, br))
            for rank, b in ((src, bs), (dst, br)):
                if rounds[rank][b] < r:
                    rounds[rank][b], changed = r, True
        if not changed:
            return max((max(r, default=0) for r in rounds), default=0)
    raise ValueError("measured_steps: the rounds depend on each other in a cycle (a deadlock)")
# --8<-- [end:measured_steps]
