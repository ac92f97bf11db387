"""`nvidia-smi topo -m` to link bandwidths and the placement of tp/cp groups (key: topology).

The fixtures are written in the format `nvidia-smi topo -m` prints (header row, one row per GPU
and NIC, affinities, the legend), with the link kinds of published DGX-class nodes: a DGX H100
(NV18 between every pair, through NVSwitch; NICs on PXB/SYS), a DGX A100 (NV12), a DGX-1 with
V100s (the hybrid cube-mesh: NV1 and NV2 between some pairs, SYS between the others) and an
8-GPU PCIe server (pairs under one switch PIX, the other GPUs of a CPU PXB, across CPUs SYS).
Run: `pytest tests/planner -k topology`.
"""

from __future__ import annotations

import json

import pytest

from tinyscale.cli import main
from tinyscale.planner import Cluster, Layout, Link, estimate, resolve_model
from tinyscale.planner.topology import intra_links, parse_topology, plan_placement

LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def _matrix(kinds: list[list[str]], nics: list[list[str]] | None = None, affinity=("0-55", "56-111")) -> str:
    n = len(kinds)
    cols = [f"GPU{i}" for i in range(n)] + [f"NIC{i}" for i in range(len(nics or []))]
    lines = ["\t" + "\t".join(cols) + "\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID"]
    for i in range(n):
        row = kinds[i] + ([nic[i] for nic in nics] if nics else [])
        lines.append(f"GPU{i}\t" + "\t".join(row) + f"\t{affinity[i * 2 // n]}\t{i * 2 // n}\t\tN/A")
    for k, nic in enumerate(nics or []):
        lines.append(f"NIC{k}\t" + "\t".join(nic) + "\t" + "\t".join("X" if j == k else "SYS" for j in range(len(nics))))
    out = "\n".join(lines) + "\n" + LEGEND
    if nics:
        out += "\nNIC Legend:\n\n" + "\n".join(f"  NIC{k}: mlx5_{k}" for k in range(len(nics))) + "\n"
    return out


def _all(n: int, kind: str) -> list[list[str]]:
    return [["X" if i == j else kind for j in range(n)] for i in range(n)]


DGX_H100 = _matrix(_all(8, "NV18"), nics=[["PXB" if i == k else "SYS" for i in range(8)] for k in range(8)])
DGX_A100 = _matrix(_all(8, "NV12"))
DGX1_V100 = _matrix([r.split() for r in """X NV1 NV1 NV2 NV2 SYS SYS SYS
NV1 X NV2 NV1 SYS NV2 SYS SYS
NV1 NV2 X NV2 SYS SYS NV1 SYS
NV2 NV1 NV2 X SYS SYS SYS NV1
NV2 SYS SYS SYS X NV1 NV1 NV2
SYS NV2 SYS SYS NV1 X NV2 NV1
SYS SYS NV1 SYS NV1 NV2 X NV2
SYS SYS SYS NV1 NV2 NV1 NV2 X""".splitlines()], affinity=("0-19,40-59", "20-39,60-79"))
PCIE_8 = _matrix([["X" if i == j else "PIX" if i // 2 == j // 2 else "PXB" if i // 4 == j // 4 else "SYS"
                   for j in range(8)] for i in range(8)])


def test_topology_parses_nvlink_and_pcie_kinds_ignoring_nics():
    h100 = parse_topology(DGX_H100)
    assert h100.num_gpus == 8 and h100.gbps(0, 7) == 450.0  # NV18: 18 links x 25 GB/s
    assert parse_topology(DGX_A100).gbps(3, 4) == 300.0
    v100 = parse_topology(DGX1_V100)
    assert (v100.gbps(0, 1), v100.gbps(0, 3), v100.gbps(0, 5)) == (25.0, 50.0, 10.0)
    pcie = parse_topology(PCIE_8)
    assert (pcie.gbps(0, 1), pcie.gbps(0, 2), pcie.gbps(0, 4)) == (24.0, 20.0, 10.0)


def test_topology_refuses_what_is_not_a_topo_matrix():
    with pytest.raises(ValueError, match="GPU0"):
        parse_topology("hello")
    broken = DGX1_V100.replace("GPU1\tNV1", "GPU1\tNV2", 1)  # GPU1->GPU0 no longer equals GPU0->GPU1
    with pytest.raises(ValueError, match="symmetric"):
        parse_topology(broken)


def test_topology_dgx1_pairs_cross_two_nvlinks_not_the_default_one():
    """Consecutive pairs (0,1), (2,3), ... of a DGX-1 include NV1 pairs; the best matching is all NV2."""
    place = plan_placement(parse_topology(DGX1_V100), 2)
    assert place["default_gbps"] == 25.0 and place["ring_gbps"] == 50.0
    topo = parse_topology(DGX1_V100)
    assert all(topo.kinds[a][b] == "NV2" for a, b in place["groups"])
    assert sorted(x for g in place["groups"] for x in g) == list(range(8))


def test_topology_dgx1_eight_ring_on_double_nvlinks_but_no_four():
    """The DGX-1's NV2 links form one ring through all 8 GPUs (0-3-2-1-5-6-7-4, the ring NCCL
    builds there) but no ring of 4: a group of 8 gets 50 GB/s, groups of 4 only 25."""
    topo = parse_topology(DGX1_V100)
    four = plan_placement(topo, 4)
    assert four["ring_gbps"] == 25.0 and four["link"].beta == 25e9 and four["link"].alpha == 3e-6
    eight = plan_placement(topo, 8)
    assert eight["ring_gbps"] == 50.0 and eight["default_gbps"] == 50.0
    ring = eight["groups"][0]
    assert all(topo.kinds[ring[k]][ring[(k + 1) % 8]] == "NV2" for k in range(8))


def test_topology_pcie_pairs_under_one_switch_and_nvswitch_nodes_need_nothing():
    pcie = plan_placement(parse_topology(PCIE_8), 2)
    assert pcie["ring_gbps"] == 24.0 and pcie["groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan_placement(parse_topology(PCIE_8), 8)["ring_gbps"] == 10.0  # 8 GPUs must cross the CPUs
    h100 = plan_placement(parse_topology(DGX_H100), 8)
    assert h100["ring_gbps"] == h100["default_gbps"] == 450.0 and "as well" in h100["why"]


def test_topology_links_set_the_planner_s_tp_cost():
    """tp 8 inside a PCIe node costs more than inside a DGX H100, group size by group size."""
    layout = Layout(dp=2, tp=8, zero_stage=1)
    times = {}
    for name, text in (("h100", DGX_H100), ("pcie", PCIE_8)):
        cluster = Cluster(gpus=16, intra_by_size=intra_links(parse_topology(text)))
        assert cluster.link("tp", {"pp": 1, "dp": 2, "cp": 1, "tp": 8}).beta == \
            plan_placement(parse_topology(text), 8)["link"].beta
        times[name] = estimate(resolve_model("llama2-7b"), layout, cluster, global_batch=16, seq_len=4096).time["tp"]
    assert times["pcie"] > 10 * times["h100"]
    assert Cluster(gpus=16).link("dp", {"pp": 1, "dp": 2, "cp": 1, "tp": 8}) == Link(10e-6, 50e9)  # across nodes


def test_topology_plan_cli_reads_the_file_and_places_groups(tmp_path, capsys):
    path = tmp_path / "topo.txt"
    path.write_text(DGX1_V100)
    assert main(["plan", "--model", "gpt2-124m", "--gpus", "8", "--global-batch", "16", "--seq-len", "1024",
                 "--gpu-mem", "16", "--peak-tflops", "125", "--topology", str(path), "--max-tp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cluster"]["gpus_per_node"] == 8 and out["ranked"]
    for place in out.get("placement", {}).values():
        assert place["ring_gbps"] >= place["default_gbps"]
