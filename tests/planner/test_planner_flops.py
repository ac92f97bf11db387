"""The planner's step time counts the FLOPs the layout runs: `tinyscale.mfu`'s hardware count.

`tinyscale.mfu.layout_flops` (measured `==` FlopCounterMode in tests/mfu) counts a fused attention
core's backward as 2.5x its forward for Q K^T and P V (Q K^T recomputed from the saved
log-sum-exp), ring attention's likewise, and a full recomputation without w_down (the
non-re-entrant checkpoint's early stop). The planner's compute and recompute seconds at a peak of
1 FLOP/s and no host overhead are FLOPs: summed over the ranks they must equal
`step_flops(...).hardware(policy)` per sequence times the global batch, on tied and untied GPTs
with GQA, a vocabulary tp does not divide, an odd layer count, cp 2 and 3 (ring), tp x cp,
dropout (explicit cores), an MoE GPT, and every policy. Before, every backward was charged 2x its
forward and every rerun whole: short of this count by the rerun Q K^T (and long by w_down).
Key: planner.
"""

from __future__ import annotations

import dataclasses

import pytest

from tinyscale.mfu import layout_flops
from tinyscale.models import GPTConfig
from tinyscale.planner import Cluster, Layout, estimate
from tinyscale.planner.estimate import step_flops

GQA = GPTConfig(vocab_size=51, max_seq_len=24, n_layer=3, n_head=4, n_kv_head=2, d_model=32, ffn_hidden=48)
TIED = dataclasses.replace(GQA, tie_embeddings=True)
DROP = dataclasses.replace(GQA, dropout=0.1, dropout_masks="counter")
STREAM = dataclasses.replace(GQA, dropout=0.1)  # masks from torch's stream: SDPA's own dropout at tp 1
MATH = dataclasses.replace(GQA, attn_impl="math")
MOE = dataclasses.replace(GQA, moe_experts=4, moe_top_k=2, moe_shared_experts=1, moe_layers=(0, 2))
SEQ, BATCH = 24, 4  # 24 tokens: 2 cp zigzag chunks of whole tp 2 shards at cp 2, and at cp 3
# (model, layout, the core it runs: causal half?, Q K^T recomputed in backward?)
CASES = [(GQA, Layout(), True, True), (TIED, Layout(tp=2), True, True), (GQA, Layout(dp=2, tp=2), True, True),
         (GQA, Layout(cp=2), True, True), (TIED, Layout(cp=3), True, True), (GQA, Layout(tp=2, cp=2), True, True),
         (MATH, Layout(), False, False),  # explicit matmuls: the whole square, P kept
         (DROP, Layout(), False, False),  # counter masks: explicit matmuls
         (STREAM, Layout(), True, True),  # SDPA's fused kernel drops its probabilities itself
         (STREAM, Layout(tp=2), False, False),  # dropout under tp: matmuls whatever attn_impl says
         (DROP, Layout(cp=2), False, True),  # ring under dropout: merge.py's whole blocks, recomputed
         (MOE, Layout(dp=2), True, True), (MOE, Layout(dp=2, ep=2), True, True)]
POLICIES = ("none", "selective", "full", "offload")


def _ids(case) -> str:
    cfg, lay = case[0], case[1]
    name = {GQA: "gqa", TIED: "tied", DROP: "dropout", STREAM: "stream", MATH: "math", MOE: "moe"}[cfg]
    return f"{name}-{lay.describe().split(', ZeRO')[0].replace(' ', '')}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_planner_flops_step_counts_layout_flops_hardware_with_the_core_the_layout_runs(case):
    cfg, lay, causal, rerun = case
    flops = step_flops(cfg, lay, SEQ)
    explicit = None if lay.cp > 1 else not rerun  # layout_flops reads it at cp 1 only
    assert flops == layout_flops(cfg, SEQ, tp=lay.tp, cp=lay.cp, causal=causal, explicit_core=explicit)
    assert (flops.backward_rerun == flops.scores > 0) == rerun  # the rerun is the forward's Q K^T, or none
    cluster = Cluster(gpus=lay.world, gpu_mem=1e18, peak_flops=1.0, efficiency=1.0, launch_overhead=0.0)
    for policy in POLICIES:
        est = estimate(cfg, dataclasses.replace(lay, policy=policy), cluster, global_batch=BATCH, seq_len=SEQ)
        assert est.problem is None, est.problem
        planned = (est.time["compute"] + est.time["recompute"]) * lay.world  # seconds at 1 FLOP/s: FLOPs
        runs = flops.hardware("none" if policy == "offload" else policy) * BATCH
        # each side is ~20 float operations on integers < 2^40, each rounding by at most 2^-53
        # relative: 20 x 1.1e-16 < 1e-14 apart, where the old rule was off by > 1e-2
        assert planned == pytest.approx(runs, rel=1e-14, abs=0), (policy, planned / runs - 1)


def test_planner_flops_fused_backward_is_two_and_a_half_forwards_of_attention():
    """The planner charges Q K^T and P V 3.5x their forward in a fused core's step (forward, 2x
    backward, Q K^T again), the rest 3x: the step's compute seconds grow by exactly the scores."""
    lay = Layout(cp=2)
    cluster = Cluster(gpus=2, gpu_mem=1e18, peak_flops=1.0, efficiency=1.0, launch_overhead=0.0)
    flops = step_flops(GQA, lay, SEQ)
    compute = estimate(GQA, lay, cluster, global_batch=BATCH, seq_len=SEQ).time["compute"] * lay.world
    assert compute == pytest.approx((3 * flops.forward + flops.scores) * BATCH, rel=1e-14, abs=0)  # as above
    assert flops.scores == flops.values  # so attention's backward is 2.5x its forward
