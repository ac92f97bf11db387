"""A node's topology from `nvidia-smi topo -m`: the GPU-to-GPU links, and where tp/cp groups go.

    topo = parse_topology(open("topo.txt").read())       # the matrix of link kinds between GPUs
    place = plan_placement(topo, 4)                       # groups of 4 GPUs with the fastest rings
    place["groups"], place["link"], place["why"]

`nvidia-smi topo -m` prints, for each pair of GPUs, how they connect (its legend): NV# (a bonded
set of # NVLinks), PIX (at most one PCIe bridge), PXB (several PCIe bridges), PHB (through a
PCIe host bridge, the CPU), NODE (between host bridges in one NUMA node), SYS (across the
CPUs' interconnect, QPI/UPI). NIC rows and columns, affinities and the legend are skipped.

Bandwidth per direction per GPU (`LINK_GBPS`): an NVLink (2.0 to 4.0) moves ~25 GB/s each way,
so NV# is # x 25 (a DGX H100's NV18: 450 GB/s; a DGX A100's NV12: 300; a DGX-1's NV1 and NV2:
25 and 50); the PCIe kinds are PCIe 4.0 x16 peer-to-peer figures, lower the more bridges the
traffic crosses. These are assumptions to override with measured numbers (`--intra-bw`).

A ring collective over a group runs at its slowest hop, so a group's bandwidth is the best ring
through it, scored by its slowest link. `plan_placement` tries every way to cut the node into
groups of `degree` GPUs (every ring through each), keeps the cut whose slowest group is fastest,
and compares it with the mesh's default, consecutive GPUs [0..k-1], [k..2k-1], ...: on a DGX-1
the default pairs (0, 1) cross one NVLink where (0, 4) cross two. A launcher applies it by
ordering the ranks (CUDA_VISIBLE_DEVICES) so that each group's GPUs are consecutive ranks.
"""

from __future__ import annotations

import itertools
import re

from tinyscale.planner.cluster import Link

LINK_GBPS = {"PIX": 24.0, "PXB": 20.0, "PHB": 16.0, "NODE": 12.0, "SYS": 10.0}
NVLINK_GBPS = 25.0  # per NVLink, per direction
ALPHA = {"NV": 3e-6, "PCIE": 8e-6}  # seconds per message: NVLink, anything over PCIe


class Topology:
    """The link kind between every two GPUs of one node (`kinds[i][j]`, "X" on the diagonal)."""

    def __init__(self, kinds: list[list[str]]) -> None:
        self.kinds = kinds

    @property
    def num_gpus(self) -> int:
        return len(self.kinds)

    def gbps(self, i: int, j: int) -> float:
        kind = self.kinds[i][j]
        if kind.startswith("NV"):
            return int(kind[2:]) * NVLINK_GBPS
        if kind not in LINK_GBPS:
            raise ValueError(f"GPU{i} to GPU{j}: unknown link kind {kind!r} (known: NV#, {', '.join(LINK_GBPS)})")
        return LINK_GBPS[kind]

    def ring_gbps(self, group: tuple[int, ...]) -> tuple[float, tuple[int, ...]]:
        """(the slowest hop of the best ring through `group`, that ring)."""
        if len(group) == 1:
            return float("inf"), group
        first, rest = group[0], group[1:]
        best = (-1.0, group)
        for order in itertools.permutations(rest):
            ring = (first, *order)
            slowest = min(self.gbps(ring[k], ring[(k + 1) % len(ring)]) for k in range(len(ring)))
            best = max(best, (slowest, ring))
        return best


def parse_topology(text: str) -> Topology:
    """The GPU x GPU block of `nvidia-smi topo -m`'s matrix (NIC rows and columns dropped)."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    header = next((ln for ln in lines if re.match(r"^\s+GPU0\b", ln) or ln.lstrip().startswith("GPU0\t")), None)
    if header is None:
        raise ValueError("no header row starting with GPU0: pass the output of `nvidia-smi topo -m`")
    columns = [c for c in re.split(r"\s+", header.strip()) if re.fullmatch(r"(GPU|NIC|mlx)\S*", c)]
    gpus = [c for c in columns if re.fullmatch(r"GPU\d+", c)]
    rows = {}
    for ln in lines:
        cells = re.split(r"\s+", ln.strip())
        if cells and re.fullmatch(r"GPU\d+", cells[0]) and len(cells) > len(gpus):
            rows[cells[0]] = cells[1:1 + len(columns)]
    if sorted(rows) != sorted(gpus):
        raise ValueError(f"rows {sorted(rows)} do not match the columns {gpus}")
    index = {c: k for k, c in enumerate(columns)}
    kinds = [[rows[g][index[h]] for h in gpus] for g in gpus]
    for i in range(len(gpus)):
        for j in range(len(gpus)):
            if (kinds[i][j] == "X") != (i == j) or kinds[i][j] != kinds[j][i]:
                raise ValueError(f"GPU{i}-GPU{j}: {kinds[i][j]!r} vs {kinds[j][i]!r}: the matrix must be "
                                 "symmetric with X on the diagonal")
    return Topology(kinds)


def _partitions(items: tuple[int, ...], size: int):
    """Every way to cut `items` into groups of `size` (the group holding items[0] first)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for mates in itertools.combinations(rest, size - 1):
        left = tuple(x for x in rest if x not in mates)
        for tail in _partitions(left, size):
            yield [(first, *mates), *tail]


def _score(topo: Topology, groups) -> tuple[float, float, list]:
    rings = [topo.ring_gbps(g) for g in groups]
    return min(r[0] for r in rings), sum(r[0] for r in rings), [r[1] for r in rings]


def plan_placement(topo: Topology, degree: int) -> dict:
    """The groups of `degree` GPUs whose slowest ring is fastest, against the consecutive default."""
    n = topo.num_gpus
    if degree < 1 or n % degree:
        raise ValueError(f"degree {degree}: it must divide the node's {n} GPUs")
    default = [tuple(range(k, k + degree)) for k in range(0, n, degree)]
    d_min, _, _ = _score(topo, default)
    best = max(((_score(topo, cut), cut) for cut in _partitions(tuple(range(n)), degree)),
               key=lambda x: (x[0][0], x[0][1]))
    (b_min, _, rings), _ = best
    if degree == 1:
        b_min = d_min = float("inf")
    nvlink = all(topo.kinds[r[k]][r[(k + 1) % len(r)]].startswith("NV") for r in rings for k in range(len(r))) \
        if degree > 1 else True
    beta = (b_min if degree > 1 else max(topo.gbps(0, j) for j in range(1, n)) if n > 1 else NVLINK_GBPS) * 1e9
    why = (f"rings of {degree}: slowest hop {b_min:g} GB/s" + (f", against {d_min:g} GB/s for consecutive GPUs"
                                                               if b_min > d_min else " (consecutive GPUs do as well)"))
    return {"degree": degree, "groups": [list(r) for r in rings], "ring_gbps": b_min, "default_gbps": d_min,
            "link": Link(alpha=ALPHA["NV" if nvlink else "PCIE"], beta=beta), "why": why}


def intra_links(topo: Topology) -> dict[int, Link]:
    """{group size: the link its best placement gives}, for every size dividing the node."""
    return {k: plan_placement(topo, k)["link"] for k in range(2, topo.num_gpus + 1) if topo.num_gpus % k == 0}
