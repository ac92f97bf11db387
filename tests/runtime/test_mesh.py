"""Mesh layout arithmetic (no processes) and ParallelMesh's groups on real ranks."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from tinyscale.dist import DIMS, MeshLayout, ParallelMesh
from tinyscale.testing import run_on_ranks

degrees = st.integers(1, 4)


@given(dp=degrees, tp=degrees, pp=degrees, cp=degrees)
def test_mesh_layout_groups_partition_the_ranks_along_every_axis(dp, tp, pp, cp):
    layout = MeshLayout(dp=dp, tp=tp, pp=pp, cp=cp)
    world = layout.world_size
    assert world == dp * tp * pp * cp
    for axis in DIMS:
        groups = layout.groups(axis)
        assert sorted(itertools.chain(*groups)) == list(range(world))  # each rank exactly once
        assert all(len(g) == getattr(layout, axis) for g in groups)
        for g in groups:  # members differ only in this coordinate, which counts 0..size-1
            coords = [layout.coords(r) for r in g]
            assert [c[axis] for c in coords] == list(range(len(g)))
            for other in DIMS:
                if other != axis:
                    assert len({c[other] for c in coords}) == 1
    for rank in range(world):
        assert layout.rank_of(**layout.coords(rank)) == rank


@given(dp=degrees, tp=degrees, pp=degrees, cp=degrees)
def test_mesh_layout_flat_dp_cp_groups_join_the_cp_groups_of_a_dp_group(dp, tp, pp, cp):
    layout = MeshLayout(dp=dp, tp=tp, pp=pp, cp=cp)
    groups = layout.flat_groups(("cp", "dp"))  # given in any order: mesh order (dp, cp)
    assert sorted(itertools.chain(*groups)) == list(range(layout.world_size))
    for g in groups:
        assert len(g) == dp * cp and g == sorted(g)
        coords = [layout.coords(r) for r in g]
        assert [(c["dp"], c["cp"]) for c in coords] == [(i, j) for i in range(dp) for j in range(cp)]
        assert len({(c["pp"], c["tp"]) for c in coords}) == 1
    assert layout.flat_groups(("dp",)) == layout.groups("dp")
    with pytest.raises(ValueError, match="unknown or repeated mesh dims"):
        layout.flat_groups(("dp", "dp"))


def test_mesh_layout_tp_is_fastest_and_pp_slowest():
    layout = MeshLayout(dp=2, tp=2, pp=2)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coords(5) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}


def test_mesh_validation_names_every_factor_and_a_fix():
    with pytest.raises(ValueError) as err:
        MeshLayout(dp=3, tp=2).check_world_size(4)
    message = str(err.value)
    for part in ("pp=1", "dp=3", "cp=1", "tp=2", "= 6 ranks", "world size is 4", "dp=2, tp=2"):
        assert part in message
    with pytest.raises(ValueError, match="tp must be a positive int, got 0"):
        MeshLayout(tp=0)
    with pytest.raises(ValueError, match="unknown mesh dim 'ep'"):
        MeshLayout().groups("ep")


def test_mesh_requires_a_process_group():
    with pytest.raises(RuntimeError, match="needs a process group"):
        ParallelMesh(dp=1)


def _mesh_groups(dp, tp, pp, cp):
    mesh = ParallelMesh(dp=dp, tp=tp, pp=pp, cp=cp)
    out = {}
    for axis in DIMS:
        out[axis] = (mesh.rank(axis), mesh.size(axis), dist.get_process_group_ranks(mesh.group(axis)))
    out["dp_cp"] = (mesh.rank("dp", "cp"), mesh.size("dp", "cp"), dist.get_process_group_ranks(mesh.group("dp", "cp")))
    return out


@pytest.mark.parametrize("shape", [dict(dp=4), dict(dp=2, tp=2), dict(pp=2, tp=2), dict(cp=2, dp=2),
                                   dict(pp=2, dp=1, cp=1, tp=2), dict(dp=1, tp=4)])
def test_mesh_process_groups_match_the_layout(shape):
    layout = MeshLayout(**shape)
    results = run_on_ranks(_mesh_groups, 4, shape.get("dp", 1), shape.get("tp", 1),
                           shape.get("pp", 1), shape.get("cp", 1))
    for rank, groups in enumerate(results):
        for axis in DIMS:
            coord, size, ranks = groups[axis]
            assert coord == layout.coords(rank)[axis]
            assert size == getattr(layout, axis)
            assert ranks == layout.group_ranks(axis, rank)
        coord, size, ranks = groups["dp_cp"]  # the flattened group context parallelism reduces over
        assert ranks == next(g for g in layout.flat_groups(("dp", "cp")) if rank in g)
        assert (coord, size) == (ranks.index(rank), layout.dp * layout.cp)


def _mesh_wrong_size():
    ParallelMesh(dp=2, tp=2)


def test_mesh_wrong_world_size_fails_on_ranks_with_the_factors():
    from tinyscale.dist import RankError

    with pytest.raises(RankError, match=r"dp=2 x cp=1 x tp=2 = 4 ranks, but the world size is 3"):
        run_on_ranks(_mesh_wrong_size, 3)
