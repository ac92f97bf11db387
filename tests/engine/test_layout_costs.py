"""DS-17 measured: what each parallelism costs per rank in memory and per step in communication,
each figure from the engine equal to its closed formula (lesson 12, "Composing the layouts").

One toy GPT (float64, tied embeddings, GQA, AdamW), trained through `ts.initialize` in each
layout: dp 2 at ZeRO 0, 1 and 3, pp 2 (1F1B), tp 2, tp 2 with sequence parallelism (2 ranks),
and dp 2 x tp 2 (4 ranks). Per rank: parameter, gradient, master and optimizer-state bytes
(`engine.memory_report(when="before_step")` of the second step, when Adam's states exist); per
step: the calls and bytes of every op on every mesh axis (the second step's `engine.comm_ledger`,
split by `tinyscale.engine.plan.traffic_by_axis`). Each equals the formula written below in
Psi (parameters), P (parameter tensors), b (rows per micro-batch), T, C, V, L (blocks), m
(micro-batches) and the degrees, with every small control message counted (the loss all-reduce
and the failure and usage flags riding in it, the world's failure flags under tp and pp, the
pipeline's 64-byte headers), so every comparison is `==`.
Run: `pytest tests/engine/test_layout_costs.py` (key layout_costs).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.dist.mesh import MeshLayout
from tinyscale.engine.plan import axis_groups, axis_of, traffic_by_axis
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import run_on_ranks

V, T, C, H, KV, L, F = 64, 16, 16, 4, 2, 2, 32  # vocab, tokens, width, heads, K/V heads, blocks, MLP width
b, m = 2, 2  # rows per micro-batch, micro-batches per step (per dp rank)
E = 8  # bytes per element: float64
STEP = 4  # Adam's `step` counter: one float32 scalar per tensor it steps
STATUS = E  # a pipeline message's status element after the tensor (its shape header went in step 1)

HD = C // H  # head dim
BLOCK = 2 * C + C * C + 2 * KV * HD * C + C * C + 3 * F * C  # 2 norms, wq, wk + wv, wo, gate + up + down
PSI = V * C + L * BLOCK + C  # embedding (tied: the head is the same tensor), blocks, final norm
P = 1 + 9 * L + 1  # parameter tensors: embedding, 9 per block, final norm
NORMS = (2 * L + 1) * C  # norm weights: replicated under tp
ACT = b * T * C * E  # one micro-batch's (b, T, C) activation
TOK = b * T * E  # one number per token (the vocab-parallel loss's max, target logit and sum of exps)


def gpt() -> GPT:
    cfg = GPTConfig(vocab_size=V, max_seq_len=T, n_layer=L, n_head=H, n_kv_head=KV, d_model=C, ffn_hidden=F,
                    tie_embeddings=True)
    return GPT(cfg, seed=3, dtype=torch.float64)


def config(dp: int, tp: int = 1, pp: int = 1, sp: bool = False, stage: int = 0) -> dict:
    parallel = {"tensor": tp, "pipeline": pp} | ({"sequence_parallel": True} if sp else {})
    return {"train_batch_size": b * m * dp, "train_micro_batch_size_per_gpu": b, "gradient_accumulation_steps": m,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage}, "parallel": parallel}


# (name, world, config keywords)
LAYOUTS = [
    ("dp2", 2, dict(dp=2)),
    ("dp2-zero1", 2, dict(dp=2, stage=1)),
    ("dp2-zero3", 2, dict(dp=2, stage=3)),
    ("pp2", 2, dict(dp=1, pp=2)),
    ("tp2", 2, dict(dp=1, tp=2)),
    ("tp2-sp", 2, dict(dp=1, tp=2, sp=True)),
    ("dp2-tp2", 4, dict(dp=2, tp=2)),
]
MODEL_STATES = ("parameters", "gradients", "master_weights", "optimizer_states")


def _measure(layouts):
    """On each rank, per layout: the second step's memory report and traffic by axis."""
    out = []
    for _name, _world, kw in layouts:
        engine = ts.initialize(gpt(), config(**kw))
        for batch in synthetic_token_batches(num_batches=2, batch_size=engine.batch.train_batch_size, seq_len=T,
                                             vocab_size=V, seed=1):
            engine.comm_ledger.clear()
            engine.train_batch(batch)
        report = engine.memory_report(when="before_step").as_dict()
        out.append(({k: report[k] for k in MODEL_STATES}, traffic_by_axis(engine.comm_ledger, engine.mesh)))
    return out


@functools.cache
def measured(world: int) -> list:
    """Every layout of one world size in one pooled call: [rank][layout] -> (memory, traffic)."""
    return run_on_ranks(_measure, world, [lay for lay in LAYOUTS if lay[1] == world])


def shard_pieces(units: list[list[int]], n: int, r: int) -> tuple[int, int]:
    """ZeRO: (elements, pieces) of rank r's shards. Each unit (its tensors' sizes, in order) is
    flattened, padded to a multiple of n and cut in n equal shards; the optimizer steps one tensor
    per piece of a parameter inside the shard (padding has no state)."""
    elements = pieces = 0
    for sizes in units:
        shard = math.ceil(sum(sizes) / n)
        lo, hi, start = r * shard, (r + 1) * shard, 0
        for size in sizes:
            inside = max(0, min(hi, start + size) - max(lo, start))
            elements, pieces, start = elements + inside, pieces + (inside > 0), start + size
    return elements, pieces


def padded(units: list[list[int]], n: int) -> int:
    """Elements of every unit padded to a multiple of n: what ZeRO's collectives move."""
    return sum(n * math.ceil(sum(sizes) / n) for sizes in units)


BLOCK_SIZES = [C, C * C, KV * HD * C, KV * HD * C, C * C, C, F * C, F * C, C * F]  # in the model's order
# ZeRO 1: one unit (reduce_bucket_size is 5e8 elements), its tensors in backward's order (last first)
ALL_IN_ONE = [([V * C] + BLOCK_SIZES * L + [C])[::-1]]
BY_MODULE = [[V * C, C]] + [BLOCK_SIZES] * L  # ZeRO 3: the root (embedding, final norm), then one per block


# --8<-- [start:formulas]
def expected(name: str, rank: int) -> tuple[dict, dict]:
    """(model-state bytes of `rank`, {axis: {op: (calls, bytes)}}) of one step of layout `name`."""
    adam = lambda elements, tensors: 2 * E * elements + STEP * tensors  # noqa: E731 - exp_avg, exp_avg_sq, step
    loss = lambda n, flags=0: (1 + n + flags) * E  # noqa: E731 - the loss, n failure flags, usage flags
    if name == "dp2":  # DDP: one bucket of every gradient + a usage flag per tensor; then the loss
        n = 2
        memory = {"parameters": E * PSI, "gradients": E * PSI, "master_weights": 0, "optimizer_states": adam(PSI, P)}
        return memory, {"dp": {"all_reduce": (2, (PSI + P) * E + loss(n))}}
    if name == "dp2-zero1":  # gradients reduce-scattered, parameters all-gathered: each once, padded
        n, (elements, pieces) = 2, shard_pieces(ALL_IN_ONE, 2, rank)
        shard = E * padded(ALL_IN_ONE, n) // n  # the last backward reduce-scattered the gradients: shards
        memory = {"parameters": E * PSI, "gradients": shard, "master_weights": shard,
                  "optimizer_states": adam(elements, pieces)}
        return memory, {"dp": {"reduce_scatter": (1, E * padded(ALL_IN_ONE, n)),
                               "all_gather": (1, E * padded(ALL_IN_ONE, n)), "all_reduce": (1, loss(n, P))}}
    if name == "dp2-zero3":  # per micro-batch: each unit gathered for forward and for backward, then reduced
        n, units, (elements, pieces) = 2, len(BY_MODULE), shard_pieces(BY_MODULE, 2, rank)
        shard = E * padded(BY_MODULE, n) // n
        memory = {"parameters": shard, "gradients": shard, "master_weights": shard,
                  "optimizer_states": adam(elements, pieces)}
        return memory, {"dp": {"all_gather": (2 * m * units, 2 * m * E * padded(BY_MODULE, n)),
                               "reduce_scatter": (m * units, m * E * padded(BY_MODULE, n)),
                               "all_reduce": (1, loss(n, P))}}
    if name == "pp2":  # m activations forward (or gradients back), each a frame; the tied table's
        stage = [V * C + BLOCK, BLOCK + C + V * C][rank]  # gradient both ways; the loss; the world's flags
        tensors = [1 + 9, 9 + 1 + 1][rank]  # (the last stage's head is its own copy of the table)
        memory = {"parameters": E * stage, "gradients": E * stage, "master_weights": 0,
                  "optimizer_states": adam(stage, tensors)}
        p2p = (m + 1, m * (ACT + STATUS) + V * C * E)
        return memory, {"pp": {"isend": p2p, "irecv": p2p, "all_reduce": (2, E + 2 * E)}}
    local = (PSI - NORMS) // 2 + NORMS  # tp 2: every matrix split in two (V even), norms replicated
    tp_memory = {"parameters": E * local, "gradients": E * local, "master_weights": 0,
                 "optimizer_states": adam(local, P)}
    # Per micro-batch: g after the embedding and after each block's wo and w_down (2L + 1, forward),
    # f before each block's q/k/v and gate/up and before the head (2L + 1, backward), and the
    # vocab-parallel loss's 3 numbers per token (forward).
    tp_calls, tp_bytes = m * (2 * (2 * L + 1) + 3), m * (2 * (2 * L + 1) * ACT + 3 * TOK)
    if name == "tp2":
        return tp_memory, {"tp": {"all_reduce": (tp_calls + 1, tp_bytes + 2 * E)}}  # + the world's flags
    if name == "tp2-sp":  # each all-reduce of (b, T, C) becomes an all-gather and a reduce-scatter of it;
        return tp_memory, {"tp": {  # each norm's weight gradient (C numbers) is all-reduced, per micro-batch
            "all_gather": (m * 2 * (2 * L + 1), m * 2 * (2 * L + 1) * ACT),
            "reduce_scatter": (m * 2 * (2 * L + 1), m * 2 * (2 * L + 1) * ACT),
            "all_reduce": (m * (3 + 2 * L + 1) + 1, m * (3 * TOK + (2 * L + 1) * C * E) + 2 * E)}}
    if name == "dp2-tp2":  # each axis carries its own formula: dp the TP shard's gradients, tp as above
        return tp_memory, {"dp": {"all_reduce": (2, (local + P) * E + loss(2))},
                           "tp": {"all_reduce": (tp_calls, tp_bytes)},
                           "world": {"all_reduce": (1, 4 * E)}}
    raise KeyError(name)
# --8<-- [end:formulas]


def _per_rank(name: str) -> list:
    world = next(w for n, w, _ in LAYOUTS if n == name)
    index = [n for n, w, _ in LAYOUTS if w == world].index(name)
    return [results[index] for results in measured(world)]


@pytest.mark.parametrize("name", [lay[0] for lay in LAYOUTS])
def test_layout_costs_memory_per_rank_equals_formula(name):
    for rank, (memory, _) in enumerate(_per_rank(name)):
        assert memory == expected(name, rank)[0], f"{name} rank {rank}"


@pytest.mark.parametrize("name", [lay[0] for lay in LAYOUTS])
def test_layout_costs_traffic_per_axis_equals_formula(name):
    for rank, (_, traffic) in enumerate(_per_rank(name)):
        got = {axis: {op: (s["calls"], s["bytes"]) for op, s in ops.items()} for axis, ops in traffic.items()}
        assert got == expected(name, rank)[1], f"{name} rank {rank}"


def test_layout_costs_pipeline_sends_least_tensor_most():
    """DS-17's corrected order, in bytes each rank sends per step (ring bus bytes): pp < dp < tp.
    pp < tp always (one boundary activation against 4L + 2 all-reduces of it); dp < tp here because
    a rank's step holds more tokens (m b T = 64) than 12 L C^2 / (4 L C), about 3C = 48."""
    sent = {name: sum(s["bus_bytes"] for ops in _per_rank(name)[0][1].values() for s in ops.values())
            for name in ("pp2", "dp2", "tp2")}
    assert sent["pp2"] < sent["dp2"] < sent["tp2"], sent


def test_layout_costs_axis_groups_name_each_group():
    """Pure arithmetic: rank 5 of pp 2 x dp 2 x cp 2 x tp 2 (coordinates 0, 1, 0, 1); a pipeline
    pair inside a wider pp group; a world that is also the tp group."""
    layout = MeshLayout(pp=2, dp=2, cp=2, tp=2)
    groups = axis_groups(layout, 5)
    assert groups == {"pp": (5, 13), "dp": (1, 5), "cp": (5, 7), "tp": (4, 5), "dp_cp": (1, 3, 5, 7),
                      "world": tuple(range(16))}
    assert [axis_of(r, groups) for r in [(4, 5), (1, 3, 5, 7), (5, 13), (13, 5), (5,), (0, 5), (2, 3)]] == \
        ["tp", "dp_cp", "pp", "pp", "self", "world", "world"]
    assert axis_of((0, 1, 2, 3), groups) == "other"
    pipeline = axis_groups(MeshLayout(pp=4, tp=2), 0)  # a send between neighbouring stages: the pp axis
    assert axis_of((0, 2), pipeline) == "pp" and axis_of((6, 0), pipeline) == "pp"
    assert axis_of((0, 1), axis_groups(MeshLayout(tp=2), 0)) == "tp"  # world 2 = tp 2: the axis, not "world"
