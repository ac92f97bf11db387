"""The cluster a plan is for: GPUs, nodes, memory, peak FLOP/s, and an alpha-beta cost per link.

A collective's time on a link of latency alpha (seconds per message) and bandwidth beta (bytes/s
one GPU can send on it), for n bytes over k ranks, ring algorithms (Thakur et al. 2005; NCCL's
"bus bandwidth" is the same accounting):

    all-reduce                2 (k-1) alpha + 2 (k-1)/k n / beta
    all-gather, reduce-scatter  (k-1) alpha +   (k-1)/k n / beta   (n: the whole, gathered tensor)
    all-to-all                  (k-1) alpha +   (k-1)/k n / beta   (n: what one rank sends in all, its
                                                                    own 1/k included: pairwise exchange)
    send (point to point)           alpha +          n / beta

Which link an axis's group crosses follows from the mesh's order, (pp, dp, cp, tp) with tp fastest
(`tinyscale.dist.mesh`): ranks are numbered node by node, so a group of k ranks `stride` apart
stays inside a node exactly when stride x k divides gpus_per_node (tp 6 on 8-GPU nodes straddles).
An ep group is a run of ep consecutive dp ranks (`tinyscale.moe.parallel`): dp's stride, ep ranks;
the expert-data-parallel group (dp / ep ranks ep apart) spans dp's block. A group that crosses nodes runs at
the inter-node link's speed (a ring is as fast as its slowest hop). `topology.py` refines the
intra-node link from `nvidia-smi topo -m`.
"""

from __future__ import annotations

import dataclasses

AXIS_ORDER = ("pp", "dp", "cp", "tp")  # the mesh's order, tp fastest (tinyscale.dist.mesh)


@dataclasses.dataclass(frozen=True)
class Link:
    """alpha: seconds per message; beta: bytes per second one GPU sends."""

    alpha: float
    beta: float

    def all_reduce(self, nbytes: float, k: int) -> float:
        return 0.0 if k <= 1 else 2 * (k - 1) * self.alpha + 2 * (k - 1) / k * nbytes / self.beta

    def all_gather(self, nbytes: float, k: int) -> float:
        return 0.0 if k <= 1 else (k - 1) * self.alpha + (k - 1) / k * nbytes / self.beta

    reduce_scatter = all_gather
    all_to_all = all_gather  # each rank sends (k-1)/k of its input, k-1 messages

    def send(self, nbytes: float) -> float:
        return self.alpha + nbytes / self.beta


@dataclasses.dataclass(frozen=True)
class Cluster:
    """What the planner plans for. Bandwidths in bytes/s per GPU, memory in bytes, peak in FLOP/s.

    `efficiency`: the share of `peak_flops` a large matmul reaches (cuBLAS on big GEMMs: 0.6-0.8
    of the dense datasheet peak); compute time is FLOPs / (peak x efficiency). `host_bw`: the
    host link (PCIe) an offloaded optimizer pays; `host_adam`: parameters per second one GPU's
    share of the host's CPU Adam steps. `hbm_bw`: the device memory bandwidth the optimizer step
    runs at. `tp_link`: force the tp/cp groups' link ("intra" or "inter"); None: from the mesh.
    `overlap`: communication runs beside compute (a GPU's copy engines and NCCL's streams); False
    where both share the same cores (CPU ranks over gloo): nothing is hidden. `launch_overhead`:
    seconds of host work per layer per micro-batch forward (kernel launches, Python; backward
    pays it twice), what a small micro-batch cannot amortise. `intra_by_size`: the link a group of
    k GPUs inside a node gets when placed on its best ring (`topology.intra_links`); else `intra`."""

    gpus: int
    gpus_per_node: int = 8
    gpu_mem: float = 80e9
    peak_flops: float = 989.5e12
    intra: Link = Link(alpha=5e-6, beta=300e9)
    inter: Link = Link(alpha=10e-6, beta=50e9)
    efficiency: float = 0.75
    host_bw: float = 25e9
    host_adam: float = 1e9
    hbm_bw: float = 3.0e12
    tp_link: str | None = None
    intra_by_size: dict | None = None  # {group size: Link} from a topology (topology.intra_links)
    overlap: bool = True
    launch_overhead: float = 30e-6
    name: str = ""

    def __post_init__(self) -> None:
        for field in ("gpus", "gpus_per_node"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field}={value!r}: give a positive int")
        for field in ("gpu_mem", "peak_flops", "efficiency", "host_bw", "host_adam", "hbm_bw"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field}={getattr(self, field)!r}: give a number > 0")
        if self.tp_link not in (None, "intra", "inter"):
            raise ValueError(f"tp_link={self.tp_link!r}: use 'intra', 'inter' or None (from the mesh)")

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    def link(self, axis: str, degrees: dict[str, int]) -> Link:
        """The link `axis`'s groups cross, for mesh degrees {"pp", "dp", "cp", "tp"} (and "ep" for
        axis "ep": runs of ep consecutive dp ranks)."""
        if axis in ("tp", "cp") and self.tp_link is not None:
            return self.intra if self.tp_link == "intra" else self.inter
        stride = 1
        for name in reversed(AXIS_ORDER):  # tp, cp, dp, pp: each axis's stride is the product after it
            if name == ("dp" if axis == "ep" else axis):
                break
            stride *= degrees[name]
        size = stride * degrees[axis]  # the block of consecutive ranks one group spans
        if self.gpus_per_node % size:  # larger than a node, or a block that straddles two nodes
            return self.inter
        return (self.intra_by_size or {}).get(size, self.intra)
