"""`tinyscale plan`: the command's flags, its rich tables and its --json form.

    tinyscale plan --model llama2-70b --gpus 512 --global-batch 1024 --seq-len 4096
    tinyscale plan --model layers=32,d_model=4096,heads=32,ffn=11008,vocab=32000 --gpus 64 --json
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from tinyscale.planner.cluster import Cluster, Link
from tinyscale.planner.models import PLANNER_PRESETS
from tinyscale.planner.search import PlanResult, plan


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="which layout to run: every layout of a cluster, ranked by step time")
    p.add_argument("--model", default="llama2-70b",
                   help=f"a preset ({', '.join(PLANNER_PRESETS)}) or sizes layers=..,d_model=..,heads=..,"
                        "kv_heads=..,ffn=..,vocab=.. (an MoE GPT: experts=..,top_k=..; ep is then searched)")
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-mem", type=float, default=80, help="GB per GPU (default 80)")
    p.add_argument("--peak-tflops", type=float, default=989.5, help="dense bf16 TFLOP/s per GPU (H100 SXM: 989.5)")
    p.add_argument("--efficiency", type=float, default=0.75, help="share of the peak a large matmul reaches")
    p.add_argument("--intra-bw", type=float, default=300, help="GB/s per GPU inside a node (NVLink)")
    p.add_argument("--inter-bw", type=float, default=50, help="GB/s per GPU between nodes (its NIC)")
    p.add_argument("--intra-latency", type=float, default=5, help="microseconds per message inside a node")
    p.add_argument("--inter-latency", type=float, default=10, help="microseconds per message between nodes")
    p.add_argument("--tp-link", choices=("intra", "inter"), help="force the link tp/cp groups use")
    p.add_argument("--max-tp", type=int, help="largest tp degree tried (default: the GPUs per node)")
    p.add_argument("--max-cp", type=int, default=8, help="largest cp degree tried (1: no context parallelism)")
    p.add_argument("--topology", help="`nvidia-smi topo -m` output of one node: the intra-node links from it")
    p.add_argument("--global-batch", type=int, default=1024, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def cluster_from_args(args: argparse.Namespace) -> tuple[Cluster, object]:
    """The cluster the flags describe; with --topology, the node's size and links from the file."""
    intra, topo, by_size, per_node = Link(alpha=args.intra_latency * 1e-6, beta=args.intra_bw * 1e9), None, None, \
        args.gpus_per_node
    if args.topology:
        from tinyscale.planner.topology import intra_links, parse_topology

        with open(args.topology) as f:
            topo = parse_topology(f.read())
        per_node, by_size = topo.num_gpus, intra_links(topo)
    cluster = Cluster(gpus=args.gpus, gpus_per_node=per_node, gpu_mem=args.gpu_mem * 1e9,
                      peak_flops=args.peak_tflops * 1e12, efficiency=args.efficiency, intra=intra,
                      inter=Link(alpha=args.inter_latency * 1e-6, beta=args.inter_bw * 1e9), tp_link=args.tp_link,
                      intra_by_size=by_size)
    return cluster, topo


def table(result: PlanResult, top: int) -> list[Table]:
    """The ranked layouts and the best of each family, with why each lost."""
    ranked = Table(title=f"tinyscale plan: {result.model.num_params() / 1e9:.1f}B parameters on {result.cluster.gpus} GPUs, "
                         f"batch {result.global_batch} x {result.seq_len} tokens",
                   caption=f"{result.considered:,} layouts tried, {result.fitting:,} fit; memory: the fullest GPU; "
                           "time: one optimizer step, modelled")
    for col, just in (("#", "right"), ("layout", "left"), ("GB/GPU", "right"), ("states/acts", "right"),
                      ("step s", "right"), ("MFU", "right"), ("why not the best", "left")):
        ranked.add_column(col, justify=just)
    for i, (est, why) in enumerate(zip(result.ranked[:top], result.reasons[:top], strict=True)):
        states = sum(est.memory[k] for k in ("parameters", "gradients", "master_weights", "optimizer_states"))
        ranked.add_row(str(i + 1), est.layout.describe(), f"{est.memory['total'] / 1e9:.1f}",
                       f"{states / 1e9:.1f}/{est.memory['activations'] / 1e9:.1f}", f"{est.time['total']:.3f}",
                       f"{est.mfu:.1%}", why)
    alt = Table(title="the best of each family")
    for col in ("family", "layout", "GB/GPU", "step s", "why it lost"):
        alt.add_column(col)
    for family, est, why in result.alternatives:
        alt.add_row(family, est.layout.describe(), f"{est.memory.get('total', 0) / 1e9:.1f}",
                    f"{est.time['total']:.3f}" if est.time else "-", why)
    best = result.ranked[0]
    parts = Table(title=f"where the best layout's step goes ({best.layout.describe()})")
    parts.add_column("part")
    parts.add_column("seconds", justify="right")
    for k, v in best.time.items():
        parts.add_row(k, f"{v:.4f}")
    return [ranked, alt, parts] if result.alternatives else [ranked, parts]


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    cluster, topo = cluster_from_args(args)
    result = plan(args.model, cluster, global_batch=args.global_batch, seq_len=args.seq_len, max_tp=args.max_tp,
                  max_cp=args.max_cp)
    placement = None
    if topo is not None:  # where the best layout's tp groups (and tp x cp blocks) go on each node
        from tinyscale.planner.topology import plan_placement

        best = result.ranked[0].layout
        placement = {f"{name} {k}": {x: y for x, y in plan_placement(topo, k).items() if x != "link"}
                     for name, k in (("tp", best.tp), ("tp x cp", best.tp * best.cp)) if k > 1}
    if args.json:
        out = result.as_dict(args.top) | ({"placement": placement} if placement is not None else {})
        print(json.dumps(out, indent=1, default=str))
        return 0
    for name, place in (placement or {}).items():
        console.print(f"topology: {name} groups on GPUs {place['groups']} ({place['why']})")
    for t in table(result, args.top):
        console.print(t)
    return 0
