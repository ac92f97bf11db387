"""The memory calculator's tensor, pipeline and context parallel parts against the engine.

`tinyscale.calculator.estimate` (the site's calculator, docs/calculator.md) adds to ZeRO's and
checkpointing's formulas the standard tp / pp / cp ones. Here one small GPT (tied table, GQA:
3 K/V heads for 6 query heads, 3 blocks) trains two steps through `ts.initialize` in tp 3, pp 3
(1F1B) and cp 3 (ring attention, bf16, ZeRO 2, full recompute) on 3 pooled gloo ranks and in pp 2
on 2, and the calculator's numbers for the same inputs are compared with the second step's `engine.comm_ledger`
(by mesh axis) and `engine.memory_report(when="before_step")`:

    tp comm       the tp axis's (b, T, C) all-reduces: the blocks', the embedding's and the head's
    pp comm       the busiest stage's sends, less each message's status element
    cp comm       the cp axis's sends, exactly (K/V at the activation dtype, dK/dV in float32)
    dp comm       over N_d = dp x cp: the cp axis's reduce-scatters and all-gathers, exactly
    parameters    Psi / (tp pp): the mean over the model-parallel ranks, each replicated copy once
    ZeRO's N_d    dp x cp: gradient and master shards of Psi / cp (Psi divisible: no padding)
    fp32 masters  fp32 at ZeRO 1 over dp 3: the fp32 master shard, 4 Psi / 3

    activations   per block (tp 3 with sequence parallelism; cp 3, ring attention, bf16, at 4 heads
                  on 1 and on 4 K/V heads): the bytes a block's first forward saves for backward
                  (saved-tensor hooks), every block exactly (the first one's RoPE rows named);
                  under bf16 at dp 3 (the norms' inputs, 1/rms and log-sum-exp in float32);
                  and cp 3 with dropout (the residual masks; ring attention saves no block)

What the calculator leaves out (the loss's traffic, replicated norms, the tied
table's copy) is derived beside each comparison. Not checked here: activations under pp (1F1B's
in-flight micro-batches: they stay `PLANNED`), and tp or cp combined with other axes.
`--thorough` adds tp 3 with full recompute (6 all-reduces per block) and cp 3's activations (fp32,
ZeRO 0: about a minute on 2 loaded cores). Key: calculator.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import tinyscale as ts
from tinyscale.calculator import PLANNED, estimate
from tinyscale.data import synthetic_token_batches
from tinyscale.engine.plan import axis_groups, axis_of
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import run_on_ranks

V, T, C, H, KV, L, F = 48, 12, 24, 6, 3, 3, 48  # vocab, tokens, width, heads, K/V heads, blocks, MLP width
b, m = 2, 2  # rows per micro-batch, micro-batches per step
SHAPE = dict(vocab_size=V, n_layer=L, n_head=H, n_kv_head=KV, d_model=C, ffn_hidden=F, tie_embeddings=True)
NORMS = (2 * L + 1) * C  # the norm weights: whole on every tp rank
# C = 24 divides every term of Psi and of NORMS: Psi / 3 and NORMS / 3 are exact, so the
# comparisons below are ==, not approximate.

# name: (tp, pp, cp, ZeRO stage, dtype, checkpointing policy)
LAYOUTS = {
    "tp3": (3, 1, 1, 0, "fp32", "none"),
    "pp3": (1, 3, 1, 0, "fp32", "none"),
    "pp2": (1, 2, 1, 0, "fp32", "none"),
    "cp3": (1, 1, 3, 2, "bf16", "full"),
    "tp3-sp": (3, 1, 1, 0, "fp32", "none"),  # sequence parallel: what the calculator's activations assume
    "cp3-none": (1, 1, 3, 0, "fp32", "none"),  # --thorough: ~60 s on 2 loaded cores (fp32 ring attention)
    "tp3-full": (3, 1, 1, 0, "fp32", "full"),
    "dp3-zero1": (1, 1, 1, 1, "fp32", "none"),  # dp 3 (DP below): fp32 ZeRO 1 keeps an fp32 master shard
    "dp3-bf16": (1, 1, 1, 0, "bf16", "none"),  # dp 3: a bf16 block keeps its norms' inputs in float32
    "cp3-gqa4": (1, 1, 3, 0, "bf16", "none"),  # ring attention at 4 heads on 1 K/V head (HEADS below)
    "cp3-mha": (1, 1, 3, 0, "bf16", "none"),  # and on 4: the GQA group is not 2, as it is in SHAPE
    "cp3-dropout": (1, 1, 3, 0, "bf16", "none"),  # dropout 0.1 (counter masks): the residual masks
}
DP = {"dp3-zero1": 3, "dp3-bf16": 3}  # data-parallel degree (1 unless named)
HEADS = {"cp3-gqa4": dict(n_head=4, n_kv_head=1), "cp3-mha": dict(n_head=4, n_kv_head=4),  # else SHAPE's 6 on 3
         "cp3-dropout": dict(dropout=0.1, dropout_masks="counter")}  # SHAPE's, with dropout
DEFAULT = ("tp3", "pp3", "cp3", "tp3-sp", "dp3-zero1", "dp3-bf16", "cp3-gqa4", "cp3-mha",
           "cp3-dropout")  # on 3 ranks; pp2 on 2


def calculator(name: str) -> dict:
    tp, pp, cp, stage, dtype, policy = LAYOUTS[name]
    return estimate(dict(model="custom", **{**SHAPE, **HEADS.get(name, {})}, dtype=dtype, optimizer="adamw",
                         dp=DP.get(name, 1), tp=tp, pp=pp, cp=cp,
                         zero_stage=stage, micro_batch=b, seq_len=T, num_microbatches=m, checkpointing=policy))


class _BlockSaved:
    """Bytes each block saves for backward in its first forward (micro-batch 1) while `on`: a pack
    hook counting each storage once, the parameters and buffers left out (as checkpointing.measure)."""

    def __init__(self, model):
        self.state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        self.on, self.block, self.seen, self.bytes = False, None, set(), {}
        for i, block in enumerate(mod for mod in model.modules() if type(mod).__name__ == "Block"):
            block.register_forward_pre_hook(lambda mod, args, i=i: self._enter(i))
            block.register_forward_hook(lambda mod, args, out: setattr(self, "block", None))

    def _enter(self, i):
        self.block = i if self.on and i not in self.bytes else None
        if self.block is not None:
            self.bytes[i] = 0

    def pack(self, t):
        key = t.untyped_storage().data_ptr()
        if self.block is not None and key not in self.seen and key not in self.state:
            self.seen.add(key)
            self.bytes[self.block] += t.untyped_storage().nbytes()
        return t


def _train(names):
    """Per layout on this rank: (Psi, model-state bytes, {(axis, op, bytes, dtype): calls}, {block: saved
    bytes}) of step 2."""
    out = []
    for name in names:
        tp, pp, cp, stage, dtype, policy = LAYOUTS[name]
        dp = DP.get(name, 1)
        model = GPT(GPTConfig(max_seq_len=T, **{**SHAPE, **HEADS.get(name, {})}), seed=3, dtype=torch.float32)
        psi = sum(p.numel() for p in model.parameters())
        engine = ts.initialize(model, {
            "train_batch_size": b * m * dp, "train_micro_batch_size_per_gpu": b, "gradient_accumulation_steps": m,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage},
            "bf16": {"enabled": dtype == "bf16"}, "activation_checkpointing": {"policy": policy},
            "parallel": {"tensor": tp, "pipeline": pp, "context": cp, "sequence_parallel": name.endswith("-sp")}})
        saved = _BlockSaved(engine.model)
        for batch in synthetic_token_batches(num_batches=2, batch_size=b * m * dp, seq_len=T, vocab_size=V, seed=1):
            engine.comm_ledger.clear()  # keep the second step's: no first-step shape headers
            with saved_tensors_hooks(saved.pack, lambda t: t):
                engine.train_batch(batch)
            saved.on = True
        groups = axis_groups(engine.mesh.layout, torch.distributed.get_rank())
        rows: dict = {}
        for row in engine.comm_ledger.rows:
            key = (axis_of(row.ranks, groups), row.op, row.bytes, row.dtype)
            rows[key] = rows.get(key, 0) + 1
        report = engine.memory_report(when="before_step").as_dict()
        out.append((psi, {k: report[k] for k in ("parameters", "gradients", "master_weights")}, rows, saved.bytes))
    return out


@functools.cache
def measured(names: tuple[str, ...]) -> dict:
    """{name: [rank] -> (Psi, memory, rows)}, every layout of `names` (one world size) in one pooled call."""
    tp, pp, cp, *_ = LAYOUTS[names[0]]
    per_rank = run_on_ranks(_train, tp * pp * cp * DP.get(names[0], 1), list(names))
    return {name: [results[i] for results in per_rank] for i, name in enumerate(names)}


def _sent(rows: dict, axis: str, op: str, size: int | None = None) -> tuple[int, int]:
    """(calls, bytes) of `op` on `axis`, only rows of `size` bytes when given."""
    hits = [(n, s) for (a, o, s, _), n in rows.items() if a == axis and o == op and size in (None, s)]
    return sum(n for n, _ in hits), sum(n * s for n, s in hits)


def _check_tp(name: str):
    tp, *_ = LAYOUTS[name]
    blocks = 6 if LAYOUTS[name][5] == "full" else 4  # full recompute runs each block's 2 forward ones again
    act, tok = b * T * C * 4, b * T * 4  # one (b, T, C) float32 activation; one float32 number per token
    ring = 2 * (tp - 1) / tp  # an all-reduce's ring factor: bytes each rank sends per byte of tensor
    want = calculator(name)["comm"]["tp"]
    for rank, (psi, _, rows, _) in enumerate(measured(DEFAULT if name in DEFAULT else (name,))[name]):
        calls, size = _sent(rows, "tp", "all_reduce", act)
        # the blocks' all-reduces and, per micro-batch, the embedding's output all-reduce (forward) and
        # the head's input one (backward), of the same size: the calculator counts all of them (it
        # used to leave out the 2 m, 1 / (2 L + 1) of the bytes here)
        assert calls == blocks * L * m + 2 * m, (name, rank, rows)
        assert calls * act * ring == want, (name, rank)
        # everything else on the tp axis is small and left out: the vocab-parallel loss's 3 numbers
        # per token per micro-batch and one all-reduce of the world's failure flags (a float64 per rank)
        rest = {k: n for k, n in rows.items() if k[0] == "tp" and k[2] != act}
        assert rest == {("tp", "all_reduce", tok, "float32"): 3 * m, ("tp", "all_reduce", 8 * 3, "float64"): 1}
        assert calculator(name)["num_params"] == psi


def test_calculator_tp_comm_equals_the_ledger_s_activation_all_reduces():
    _check_tp("tp3")


@pytest.mark.thorough
def test_calculator_tp_comm_with_full_recompute_equals_the_ledger_thorough():
    _check_tp("tp3-full")


def test_calculator_tp_parameters_per_rank_are_the_shard_less_replicated_norms():
    """Psi / tp: each rank holds 1/tp of every matrix (V, heads, K/V heads divide by 3: no padding,
    no copies) and the norms whole; the calculator counts the norms once over the group."""
    want = calculator("tp3")["device"]
    for rank, (psi, memory, _, _) in enumerate(measured(DEFAULT)["tp3"]):
        assert memory["parameters"] == 4 * ((psi - NORMS) // 3 + NORMS), rank
        assert memory["parameters"] - 4 * NORMS * 2 // 3 == want["parameters"] == 4 * psi / 3, rank
        assert memory["gradients"] - 4 * NORMS * 2 // 3 == want["gradients"], rank


@pytest.mark.parametrize("name", ["pp3", "pp2"])
def test_calculator_pp_comm_is_the_busiest_stages_sends(name):
    """1F1B: per micro-batch the first stage sends its output forward, the last its input's
    gradient back, a middle one both: the calculator's min(pp - 1, 2) activations per micro-batch
    is the busiest stage's (pp 2: 1, each stage an end). Each message carries one status element
    (float32) after the tensor; the end stages also send the tied table's gradient to each other
    once per step."""
    act, pp = b * T * C * 4, LAYOUTS[name][1]
    want = calculator(name)["comm"]["pp"]
    per_rank = measured(DEFAULT if name in DEFAULT else (name,))[name]
    sends = [_sent(rows, "pp", "isend", act + 4) for _, _, rows, _ in per_rank]
    assert [calls for calls, _ in sends] == [m] + [2 * m] * (pp - 2) + [m]
    assert max(size - 4 * calls for calls, size in sends) == want == min(pp - 1, 2) * act * m
    for rank in (0, pp - 1):  # the tied table's gradient, V x C float32: left out (the calculator counts no embedding)
        assert _sent(per_rank[rank][2], "pp", "isend") == (m + 1, m * (act + 4) + V * C * 4)


def test_calculator_pp_parameters_per_rank_are_the_mean_stage():
    """Psi / pp: stage 0 holds the embedding and a block, stage 1 a block, stage 2 a block, the final
    norm and its own copy of the tied table (the head); the copy left out, the mean is Psi / 3."""
    want = calculator("pp3")["device"]["parameters"]
    per_rank = measured(DEFAULT)["pp3"]
    psi = per_rank[0][0]
    held = [memory["parameters"] for _, memory, _, _ in per_rank]
    assert sum(held) - 4 * V * C == 4 * psi and (sum(held) - 4 * V * C) / 3 == want, held


def test_calculator_cp_comm_equals_the_ring_sends():
    """Ring attention over cp 3, per block and micro-batch: the K/V block hops cp - 1 times in the
    forward, again in the recomputed forward ("full") and in the backward, at bf16; dK/dV hop cp - 1
    times in float32. The calculator's (6 p + 2 x 4) (cp - 1) (T/cp) b kv_dim per block (it used
    to count dK/dV at p: 2 bytes short per element under bf16)."""
    kv = 2 * b * (T // 3) * KV * (C // H)  # one packed K and V block: elements
    want = calculator("cp3")["comm"]["cp"]
    for rank, (_, _, rows, _) in enumerate(measured(DEFAULT)["cp3"]):
        sends = {(size, dtype): n for (axis, op, size, dtype), n in rows.items() if axis == "cp" and op == "isend"}
        assert sends == {(2 * kv, "bfloat16"): 3 * 2 * L * m, (4 * kv, "float32"): 2 * L * m}, (rank, sends)
        assert sum(size * n for (size, _), n in sends.items()) == want, rank


def test_calculator_cp_zero_shards_over_dp_times_cp():
    """N_d = dp x cp: ZeRO 2 over the 3 cp ranks (dp 1) holds the bf16 parameters whole and 1/3 of
    the gradients (bf16) and masters (fp32); its reduce-scatter per micro-batch and one all-gather
    per step on the cp axis are the calculator's dp traffic."""
    out = calculator("cp3")
    for rank, (psi, memory, rows, _) in enumerate(measured(DEFAULT)["cp3"]):
        assert memory == {"parameters": 2 * psi, "gradients": 2 * psi // 3, "master_weights": 4 * psi // 3}
        assert {k: out["device"][k] for k in memory} == memory, rank
        zero = [_sent(rows, "cp", op, 2 * psi) for op in ("reduce_scatter", "all_gather")]
        assert zero == [(m, m * 2 * psi), (1, 2 * psi)], (rank, rows)
        assert sum(size for _, size in zero) * 2 / 3 == out["comm"]["dp"], rank  # ring: (n - 1) / n each


@pytest.mark.parametrize("name", ["tp3-sp", "dp3-bf16", "cp3-gqa4", "cp3-mha", "cp3-dropout",
                                  pytest.param("cp3-none", marks=pytest.mark.thorough)])
def test_calculator_tp_cp_activations_per_block_equal_the_saved_tensors(name):
    """Per block and micro-batch, what a rank saves for backward: cp splits our block's tensors
    over the tokens, and ring attention keeps k and v unrepeated (K/V heads wide, not heads) and its
    own output in float32 beside wo's input: the planner's `layer_activation_bytes`, which the
    calculator calls under cp (bf16 at 4 heads on 1 and on 4 K/V heads; fp32 at 6 on 3, --thorough).
    Counting ring's block as A / cp, as the calculator did, is right at 2 heads per K/V head
    only (SHAPE's) and fails both bf16 cases. tp with sequence parallelism splits all but the two norms' outputs,
    which the column-parallel layers save as they are all-gathered, whole (Megatron gathers them
    again in backward instead): (A + (tp - 1) 2 s b h p) / (tp cp). Without pp and checkpointing
    the calculator's activations are L such blocks. Under bf16 (dp 3) the norms' upcast inputs, 1/rms
    and sdpa's log-sum-exp are float32 (`_fp32_saved`): counting them at 2 bytes, as
    `block_saved_bytes` does, is 2 (2 s b h + 2 s b + a s b) bytes a block short and fails. With
    dropout under cp (bf16, 0.1, counter masks) the block keeps the two residual masks, 2 (T/cp) b C
    p bytes, and ring attention nothing more: it redraws each block's mask in its backward (the
    calculator left dropout under cp out, 8.5% short here)."""
    per_block = calculator(name)["device"]["activations"] / L
    for rank, (*_, saved) in enumerate(measured(DEFAULT if name in DEFAULT else (name,))[name]):
        assert [saved[i] for i in range(1, L)] == [per_block] * (L - 1), (name, rank, saved, per_block)
        # the first block under cp keeps this rank's float32 RoPE rows too (cos and sin, 2 (T/cp) D
        # float32: 128 bytes here), once per micro-batch, not per block: the calculator leaves them out
        # (as it does the loss's bool per token and 8 bytes, saved outside the blocks)
        tp, pp, cp, *_ = LAYOUTS[name]
        head_dim = C // {**SHAPE, **HEADS.get(name, {})}["n_head"]
        rope = 2 * (T // cp) * head_dim * 4 if cp > 1 else 0
        assert saved[0] == per_block + rope, (name, rank, saved, per_block)


def test_calculator_planned_names_only_the_unmeasured_parts():
    assert PLANNED == ("pp",)


def test_calculator_fp32_zero1_counts_the_master_shard():
    """fp32 under ZeRO 1 over dp 3: the optimizer steps an fp32 copy of the rank's third (as
    DeepSpeed's ZeRO does), 4 Psi / 3 beside the fp32 parameters (Psi divides by 3: no padding).
    The calculator counted 0 for it (fp32's 4 + 4 + K without a master). The report is taken after
    the last backward reduce-scattered the gradients: a third of them, where the calculator counts
    the whole gradient that ZeRO 1 holds between an accumulation's micro-batches. ZeRO 1's traffic:
    one reduce-scatter and one all-gather of Psi fp32 elements per step, ring (n - 1) / n each."""
    out = calculator("dp3-zero1")
    for rank, (psi, memory, rows, _) in enumerate(measured(DEFAULT)["dp3-zero1"]):
        assert memory["master_weights"] == 4 * psi // 3 == out["device"]["master_weights"], rank
        assert memory["parameters"] == 4 * psi == out["device"]["parameters"], rank
        assert memory["gradients"] == 4 * psi // 3 == out["device"]["gradients"] / 3, rank
        zero = [_sent(rows, "dp", op, 4 * psi) for op in ("reduce_scatter", "all_gather")]
        assert zero == [(1, 4 * psi), (1, 4 * psi)], (rank, rows)
        assert sum(size for _, size in zero) * 2 / 3 == out["comm"]["dp"], rank
