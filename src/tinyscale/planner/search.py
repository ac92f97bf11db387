"""Which layout to run: enumerate every layout of a cluster, keep those that fit, rank by step time.

    result = plan("llama2-70b", Cluster(gpus=512), global_batch=1024, seq_len=4096)
    result.ranked[0]              # the fastest layout that fits (an `Estimate`)
    result.reasons[i]             # why ranked[i] lost to ranked[0]
    result.alternatives           # the best of each family (no pp, no tp, ZeRO 3, offload, ...)

Enumerated: tp (dividing the heads, at most a node unless `max_tp` says more), cp, pp (at most
the layers), dp the rest; micro-batch 1, 2, 4, 8 (dividing the batch per dp rank); schedules
1f1b, interleaved 1F1B with 2 chunks and every chunk count that splits the layers evenly
(`virtual_stage_choices`), ZB-H1 (GPipe's afab has 1F1B's time and more memory);
ZeRO 0-3 and CPU offload at stages 2-3 (ZeRO-Offload); activation checkpointing none,
selective, full. An MoE GPT (`GPTConfig.moe_experts`) also tries every ep that the engine takes
(`engine.expert.check_layout`): ep dividing dp and the expert count; it gets no cp and no SP
(the engine refuses both: each rank would route a slice of the sequence); a dense GPT gets ep 1.
Two passes: every candidate costed with the schedules' closed forms
(`estimate(..., simulate_pipeline=False)`; one whose model states alone exceed the memory stops
there), then the `refine` fastest that fit again with the pipeline simulated on their own
per-stage costs (one simulation per distinct costing); the ranking is the second pass's.
"""

from __future__ import annotations

import dataclasses

from tinyscale.models.config import GPTConfig
from tinyscale.planner.cluster import Cluster
from tinyscale.planner.estimate import Estimate, Layout, estimate
from tinyscale.planner.models import resolve_model

PARTS = ("compute", "recompute", "tp", "cp", "ep", "bubble", "dp", "optimizer")
ZERO = ((0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "cpu"), (3, "cpu"))
POLICIES = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def virtual_stage_choices(n_layer: int, pp: int) -> list[int]:
    """The chunks per rank interleaved 1F1B tries at pp: 2, and every v whose pp x v model stages
    take the same number of blocks (n_layer % (pp v) == 0, NeMo's and Megatron-LM's rule), up to
    one block a stage. The engine runs any pp x v <= n_layer (`engine.pipeline_layout`); the
    uneven ones in between (besides 2) are left out to keep the search small."""
    return [v for v in range(2, n_layer // pp + 1) if v == 2 or n_layer % (pp * v) == 0]


def expert_choices(cfg: GPTConfig, dp: int) -> list[int]:
    """The ep degrees tried at dp: 1 for a dense GPT; for an MoE GPT every ep dividing both dp (the
    ep groups are runs of ep dp ranks) and the expert count (each ep rank computes E / ep experts),
    the engine's two rules (`engine.expert.check_layout`)."""
    return [e for e in _divisors(dp) if cfg.moe_experts % e == 0] if cfg.moe_experts else [1]


def layouts(cfg: GPTConfig, gpus: int, global_batch: int, *, max_tp: int, max_cp: int = 8):
    """Every candidate `Layout` on `gpus` GPUs (see the module doc)."""
    if cfg.moe_experts:
        max_cp = 1  # the engine refuses cp with an MoE GPT
    sp = False if cfg.moe_experts else None  # ... and SP: tp > 1 runs without it
    for tp in (t for t in _divisors(gpus) if t <= max_tp):
        for cp in (c for c in _divisors(gpus // tp) if c <= max_cp):
            for pp in (p for p in _divisors(gpus // (tp * cp)) if p <= cfg.n_layer):
                dp = gpus // (tp * cp * pp)
                if global_batch % dp:
                    continue
                for b in (b for b in MICRO_BATCHES if (global_batch // dp) % b == 0):
                    m = global_batch // (dp * b)
                    schedules = [("1f1b", 1)]
                    if pp > 1:
                        schedules += [("zb_h1", 1)]
                        if m % pp == 0:
                            schedules += [("interleaved_1f1b", v) for v in virtual_stage_choices(cfg.n_layer, pp)]
                    for schedule, v in schedules:
                        for ep in expert_choices(cfg, dp):
                            for stage, offload in ZERO:
                                for policy in POLICIES:
                                    yield Layout(dp=dp, tp=tp, pp=pp, cp=cp, virtual_stages=v, schedule=schedule,
                                                 zero_stage=stage, offload=offload, policy=policy, micro_batch=b,
                                                 sequence_parallel=sp, ep=ep)


LABELS = {
    "compute": "more FLOPs on its slowest GPU",
    "recompute": "recomputation ({policy})",
    "tp": "tp {tp}'s per-layer collectives ({tp_link})",
    "cp": "cp {cp}'s ring passes not hidden behind attention",
    "ep": "ep {ep}'s all-to-alls ({ep_link})",
    "bubble": "the pipeline bubble ({bubble:.0%} of its step)",
    "dp": "{dp_what} not hidden ({dp_link})",
    "optimizer": "the optimizer step ({opt_where})",
}


def _where(cluster: Cluster, axis: str, degrees: dict) -> str:
    link = cluster.link(axis, degrees)
    return ("inter-node" if link is cluster.inter else "in a node") + f", {link.beta / 1e9:g} GB/s"


def why_lost(est: Estimate, best: Estimate, cluster: Cluster) -> str:
    """One line: what costs `est` the most time against `best`, or why it does not fit."""
    if not est.fits:
        return est.problem or "does not fit"
    slower = est.time["total"] / best.time["total"] - 1
    diffs = {k: est.time[k] - best.time[k] for k in PARTS}
    part = max(diffs, key=diffs.get)
    lay = est.layout
    degrees = {"pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "tp": lay.tp, "ep": lay.ep}
    words = LABELS[part].format(
        policy=lay.policy, tp=lay.tp, cp=lay.cp, ep=lay.ep, bubble=est.time["bubble"] / est.time["total"],
        tp_link=_where(cluster, "tp", degrees), dp_link=_where(cluster, "dp", degrees),
        ep_link=_where(cluster, "ep", degrees),
        dp_what="ZeRO 3's gathers" if lay.zero_stage == 3 else "the gradient reduction",
        opt_where="offloaded: PCIe and the host's Adam" if lay.offload != "none" else "on the GPU")
    if slower < 0.005:
        more = est.memory["total"] - best.memory["total"]
        return f"ties on time; {more / 1e9:+.1f} GB per GPU" if more else "ties"
    return f"+{slower:.0%} step time: {words} (+{diffs[part] * 1e3:,.0f} ms)"


@dataclasses.dataclass
class PlanResult:
    model: GPTConfig
    cluster: Cluster
    global_batch: int
    seq_len: int
    ranked: list[Estimate]             # the refined fastest that fit, fastest first
    reasons: list[str]                 # why each of `ranked` lost to the first ("best" for it)
    alternatives: list[tuple[str, Estimate, str]]  # (family, its best, why it lost)
    considered: int
    valid: int
    fitting: int

    def as_dict(self, top: int = 5) -> dict:
        def row(est: Estimate, why: str) -> dict:
            return {"layout": dataclasses.asdict(est.layout) | {"sequence_parallel": est.layout.sp},
                    "describe": est.layout.describe(), "config": est.layout.config(self.global_batch),
                    "memory_bytes": est.memory, "time_s": est.time, "mfu": est.mfu, "fits": est.fits,
                    "why_not_best": why}
        return {"cluster": dataclasses.asdict(self.cluster), "model": dataclasses.asdict(self.model),
                "global_batch": self.global_batch, "seq_len": self.seq_len,
                "considered": self.considered, "valid": self.valid, "fitting": self.fitting,
                "ranked": [row(e, w) for e, w in zip(self.ranked[:top], self.reasons[:top], strict=True)],
                "alternatives": [{"family": f} | row(e, w) for f, e, w in self.alternatives]}


FAMILIES = {
    "data parallel only (ZeRO)": lambda lay: lay.tp == lay.pp == lay.cp == 1,
    "no pipeline": lambda lay: lay.pp == 1,
    "no tensor parallelism": lambda lay: lay.tp == 1,
    "ZeRO 3": lambda lay: lay.zero_stage == 3,
    "CPU offload": lambda lay: lay.offload != "none",
    "no activation checkpointing": lambda lay: lay.policy == "none",
    "context parallel": lambda lay: lay.cp > 1,
}


def moe_families(cluster: Cluster) -> dict:
    """An MoE GPT's families too: no ep, and ep groups that cross nodes (all-to-all on the NIC)."""
    def across(lay) -> bool:
        degrees = {"pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "tp": lay.tp, "ep": lay.ep}
        return lay.ep > 1 and cluster.link("ep", degrees) is cluster.inter

    return {"no expert parallelism": lambda lay: lay.ep == 1, "expert parallelism across nodes": across}


def plan(model: str | GPTConfig, cluster: Cluster, *, global_batch: int, seq_len: int, refine: int = 24,
         max_tp: int | None = None, max_cp: int = 8, layouts_to_try=None, dtype_bytes: int = 4, compute_bytes: int = 2) -> PlanResult:
    """Every layout of `cluster` for `model`, ranked (see the module doc). `layouts_to_try`:
    cost only these (the CPU tests' handful) instead of enumerating."""
    cfg = resolve_model(model)
    if not isinstance(global_batch, int) or global_batch < 1 or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"global_batch={global_batch!r}, seq_len={seq_len!r}: give positive ints")
    kw = dict(global_batch=global_batch, seq_len=seq_len, dtype_bytes=dtype_bytes, compute_bytes=compute_bytes)
    tried = list(layouts_to_try) if layouts_to_try is not None else list(
        layouts(cfg, cluster.gpus, global_batch, max_tp=max_tp or cluster.gpus_per_node, max_cp=max_cp))
    first = [estimate(cfg, lay, cluster, simulate_pipeline=False, **kw) for lay in tried]
    valid = [e for e in first if e.fits or e.memory]
    fitting = sorted((e for e in valid if e.fits), key=lambda e: e.time["total"])
    if not fitting:
        closest = min(valid, key=lambda e: e.memory["total"], default=None)
        raise ValueError(f"no layout of {cfg.num_params() / 1e9:.1f}B parameters fits {cluster.gpus} GPUs of "
                         f"{cluster.gpu_mem / 1e9:.0f} GB" + (f": the smallest, {closest.layout.describe()}, "
                                                              f"{closest.problem}" if closest else "")
                         + "; add GPUs, memory, or shorten the micro-batch's sequence")
    refined = [estimate(cfg, e.layout, cluster, **kw) for e in fitting[:refine]]
    ranked = sorted((e for e in refined if e.fits), key=lambda e: e.time["total"]) or fitting[:1]
    best = ranked[0]
    reasons = ["best"] + [why_lost(e, best, cluster) for e in ranked[1:]]
    alternatives = []
    shown = {e.layout for e in ranked[:5]}
    for family, keep in (FAMILIES | (moe_families(cluster) if cfg.moe_experts else {})).items():
        members = [e for e in fitting if keep(e.layout)]
        if members and members[0].layout not in shown:
            alt = estimate(cfg, members[0].layout, cluster, **kw)
            alternatives.append((family, alt, why_lost(alt, best, cluster)))
        elif not members:
            near = min((e for e in valid if keep(e.layout)), key=lambda e: e.memory["total"], default=None)
            if near is not None:
                alternatives.append((family, near, near.problem or ""))
    return PlanResult(cfg, cluster, global_batch, seq_len, ranked, reasons, alternatives,
                      considered=len(tried), valid=len(valid), fitting=len(fitting))
