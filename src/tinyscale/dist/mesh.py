"""`ParallelMesh`: the ranks of a job arranged as a grid (pp, dp, cp, tp).

A world of ``pp * dp * cp * tp`` ranks is laid out row-major over the dims
``("pp", "dp", "cp", "tp")``, so tp varies fastest: ranks 0..tp-1 form the first
tensor-parallel group. On a real cluster consecutive ranks share a node, so the most
talkative parallelism (TP, an all-reduce in every layer) gets the fastest links (NVLink),
and the least talkative (PP, one activation per micro-batch) crosses nodes.

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

`MeshLayout` is that arithmetic alone, testable without processes; `ParallelMesh` builds
the matching `torch.distributed.device_mesh.DeviceMesh` and hands out its process groups:

    mesh = ParallelMesh(dp=2, tp=2)       # inside a 4-rank job
    mesh.group("tp"), mesh.rank("tp"), mesh.size("dp")

Several axes name their flattened group: ``mesh.group("dp", "cp")`` holds the ranks that
differ only in dp and cp (torchtitan's ``dp_cp`` mesh, which FSDP shards over when the
batch is split over dp and the sequence over cp).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch.distributed as dist

DIMS = ("pp", "dp", "cp", "tp")


def _factorizations(world_size: int) -> list[str]:
    """Up to four valid (dp, tp) choices, for error messages."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return [f"dp={world_size // tp}, tp={tp}" for tp in divisors][:4]


@dataclass(frozen=True)
class MeshLayout:
    """The rank grid of a (pp, dp, cp, tp) mesh: pure arithmetic, no processes."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self):
        for name in DIMS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelMesh: {name} must be a positive int, got {value!r}")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.cp, self.tp)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def check_world_size(self, world_size: int) -> None:
        if self.world_size != world_size:
            factors = " x ".join(f"{n}={getattr(self, n)}" for n in DIMS)
            raise ValueError(
                f"ParallelMesh: {factors} = {self.world_size} ranks, but the world size is "
                f"{world_size}. Choose degrees whose product is {world_size}, for example "
                f"{'; '.join(_factorizations(world_size))}."
            )

    # --8<-- [start:coords]
    def coords(self, rank: int) -> dict[str, int]:
        """{"pp": i, "dp": j, "cp": k, "tp": l} of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks")
        out = {}
        for name, size in zip(reversed(DIMS), reversed(self.shape)):
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in DIMS}

    def rank_of(self, **coords: int) -> int:
        """The global rank at the given coordinates (missing dims are 0)."""
        unknown = set(coords) - set(DIMS)
        if unknown:
            raise ValueError(f"unknown mesh dims {sorted(unknown)}; dims are {DIMS}")
        rank = 0
        for name, size in zip(DIMS, self.shape):
            i = coords.get(name, 0)
            if not 0 <= i < size:
                raise ValueError(f"{name}={i} is outside 0..{size - 1}")
            rank = rank * size + i
        return rank
    # --8<-- [end:coords]

    # --8<-- [start:groups]
    def groups(self, axis: str) -> list[list[int]]:
        """Every group along `axis`: lists of global ranks that differ only in that coordinate."""
        if axis not in DIMS:
            raise ValueError(f"unknown mesh dim {axis!r}; dims are {DIMS}")
        others = [n for n in DIMS if n != axis]
        out = []
        for fixed in itertools.product(*(range(getattr(self, n)) for n in others)):
            base = dict(zip(others, fixed))
            out.append([self.rank_of(**base, **{axis: i}) for i in range(getattr(self, axis))])
        return out
    # --8<-- [end:groups]

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """The global ranks of `rank`'s group along `axis`."""
        c = self.coords(rank)
        return [self.rank_of(**{**c, axis: i}) for i in range(getattr(self, axis))]

    def flat_groups(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Every group over several axes flattened: global ranks that differ only in `axes`,
        ascending (row-major over `axes`, the last of them fastest, as in the whole mesh)."""
        axes = self._check_axes(axes)
        others = [n for n in DIMS if n not in axes]
        out = []
        for fixed in itertools.product(*(range(getattr(self, n)) for n in others)):
            base = dict(zip(others, fixed))
            out.append([self.rank_of(**base, **dict(zip(axes, inner)))
                        for inner in itertools.product(*(range(getattr(self, a)) for a in axes))])
        return out

    def _check_axes(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        """`axes` in mesh order; unknown or repeated names raise."""
        unknown = [a for a in axes if a not in DIMS]
        if unknown or len(set(axes)) != len(axes) or not axes:
            raise ValueError(f"unknown or repeated mesh dims in {axes}; dims are {DIMS}, each at most once")
        return tuple(n for n in DIMS if n in axes)


# DeviceMeshes built in this process, by (shape, device type). Building one is a collective
# (new process groups); a persistent test worker would otherwise build hundreds.
_cache: dict[tuple, object] = {}
_flat_cache: dict[tuple, object] = {}  # flattened groups, by (shape, axes, world)


class ParallelMesh:
    """The job's ranks as a (pp, dp, cp, tp) grid with one process group per axis.

    Must be constructed on every rank, in the same order (creating groups is collective).
    """

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, *, device_type: str | None = None):
        self.layout = MeshLayout(dp=dp, tp=tp, pp=pp, cp=cp)
        if not dist.is_initialized():
            raise RuntimeError(
                "ParallelMesh needs a process group: run inside tinyscale.dist.launch(...) "
                "or call tinyscale.dist.init() under torchrun. MeshLayout does the rank "
                "arithmetic without processes."
            )
        self.layout.check_world_size(dist.get_world_size())
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        key = (self.layout.shape, device_type, id(dist.group.WORLD))
        if key not in _cache:
            from torch.distributed.device_mesh import init_device_mesh

            _cache[key] = init_device_mesh(device_type, self.layout.shape, mesh_dim_names=DIMS)
        self.device_mesh = _cache[key]
        self._rank = dist.get_rank()

    def group(self, *axes: str):
        """The process group of this rank along `axes` ("pp", "dp", "cp" or "tp"; several:
        their flattened group, e.g. ``group("dp", "cp")``)."""
        axes = self.layout._check_axes(axes)
        wide = [a for a in axes if getattr(self.layout, a) > 1]
        if len(wide) <= 1:  # the same ranks as one axis's group: no new group needed
            return self.device_mesh.get_group(wide[0] if wide else axes[0])
        key = (self.layout.shape, axes, id(dist.group.WORLD))
        if key not in _flat_cache:  # collective: every rank creates every group, in the same order
            _flat_cache[key], _ = dist.new_subgroups_by_enumeration(self.layout.flat_groups(axes))
        return _flat_cache[key]

    def rank(self, *axes: str) -> int:
        """This rank's coordinate along `axes` (its rank within that group; several axes:
        row-major over them, the rank in their flattened group)."""
        coords = self.layout.coords(self._rank)
        out = 0
        for axis in self.layout._check_axes(axes):
            out = out * getattr(self.layout, axis) + coords[axis]
        return out

    def size(self, *axes: str) -> int:
        return math.prod(getattr(self.layout, a) for a in self.layout._check_axes(axes))

    def group_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along `axis`."""
        return self.layout.group_ranks(axis, self._rank)

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={getattr(self.layout, n)}" for n in DIMS)
        return f"ParallelMesh({dims}, rank={self._rank})"
