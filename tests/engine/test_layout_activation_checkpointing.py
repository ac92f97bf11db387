"""Activation checkpointing in every layout (`pytest -k layout_activation_checkpointing`).

Every policy (full and selective with both checkpoint variants, every_k, offload) under tensor
parallelism (with and without sequence parallelism), context parallelism (ring, Ulysses),
pipeline parallelism (1F1B, interleaved, zero-bubble's split B/W passes), tp x cp, pp x tp and
dp x tp at ZeRO 3 trains bit-identically (`torch.equal` on every loss and every tensor of
`full_state_dict()`, float64) to the same layout without checkpointing; dropout on under tensor
parallelism in both modes (the tracker's stream, and the exact masks of one process), so a
recomputation that drew new masks would show. One case per layout also equals
`tinyscale.reference.train` at rtol 1e-10 (layouts whose dropout masks one process draws).

The model is the odd GPT of issue 25: vocab 61, 6 query / 2 K/V heads, tied, sequence 22,
clipping and weight decay on, two micro-batches per step. The layouts of one world size run in
one pooled multi-rank call (cached); the default runs a few policies per layout, rotated so every
policy appears, and `--thorough` every policy in every layout.
Run: `pytest tests/engine/test_layout_activation_checkpointing.py [--thorough]`.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.checkpointing import policy_of
from tinyscale.data import synthetic_token_batches
from tinyscale.engine.engine import check_supported
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks

VOCAB, SEQ, STEPS = 61, 22, 2
DROPOUT_SEED = 17  # rank 0's generator: the engine gives it to every TP rank
POLICIES = {"full": {"policy": "full"}, "full-reentrant": {"policy": "full", "use_reentrant": True},
            "every_k": {"policy": "every_k", "every_k": 2}, "selective": {"policy": "selective"},
            "selective-reentrant": {"policy": "selective", "use_reentrant": True}, "offload": {"policy": "offload"},
            # DeepSpeed's options: the checkpoints on the host, and (tp > 1, no SP) split over the TP group
            "full-cpu": {"policy": "full", "cpu_checkpointing": True},
            "selective-cpu": {"policy": "selective", "cpu_checkpointing": True},
            "full-partition": {"policy": "full", "partition_activations": True},
            "every_k-partition-cpu": {"policy": "every_k", "every_k": 2, "partition_activations": True,
                                      "cpu_checkpointing": True},
            "full-reentrant-partition": {"policy": "full", "use_reentrant": True, "partition_activations": True}}

# name -> (world, parallel section, zero stage, dropout, n_layer, clip, policies in the default run).
# Tracker-mode dropout draws other masks than one process: compared with no checkpointing only.
LAYOUTS = {
    "tp2": (2, {"tensor": 2}, 0, 0.0, 3, 0.05, ("full", "selective-reentrant")),
    "tp2-sp-tracker": (2, {"tensor": 2, "sequence_parallel": True, "tensor_dropout": "tracker"}, 0, 0.2, 3, 0.05,
                       ("full", "selective", "full-reentrant")),
    "tp2-tracker": (2, {"tensor": 2, "tensor_dropout": "tracker"}, 0, 0.2, 3, 0.0,
                    ("selective-reentrant", "every_k-partition-cpu")),
    "tp2-sp-exact": (2, {"tensor": 2, "sequence_parallel": True, "tensor_dropout": "exact"}, 0, 0.2, 3, 0.05,
                     ("every_k", "selective-reentrant")),
    "cp2-ring": (2, {"context": 2, "context_algorithm": "ring"}, 1, 0.0, 3, 0.05, ("selective", "full-reentrant")),
    "cp2-ulysses": (2, {"context": 2, "context_algorithm": "ulysses"}, 0, 0.0, 3, 0.05, ("full-cpu", "offload")),
    "pp2-1f1b": (2, {"pipeline": 2, "pipeline_schedule": "1f1b"}, 0, 0.0, 3, 0.05, ("full-reentrant", "every_k")),
    "pp2-interleaved": (2, {"pipeline": 2, "pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2}, 0, 0.0, 5,
                        0.0, ("selective",)),
    "pp2-zb_h1": (2, {"pipeline": 2, "pipeline_schedule": "zb_h1"}, 0, 0.0, 3, 0.05, ("full", "selective-cpu")),
    "tp2-cp2": (4, {"tensor": 2, "context": 2}, 0, 0.0, 3, 0.05, ("full-partition", "selective-reentrant")),
    "pp2-tp2": (4, {"pipeline": 2, "tensor": 2}, 0, 0.0, 3, 0.05, ("selective", "full-reentrant-partition")),
    "dp2-tp2-zero3": (4, {"tensor": 2, "sequence_parallel": True}, 3, 0.2, 3, 0.05,
                      ("full", "full-reentrant", "selective")),
}


def refused(layout: str, policy: str) -> bool:
    """Zero-bubble's B pass asks autograd for the input gradient alone (torch.autograd.grad with
    inputs), which a re-entrant checkpoint cannot give (its backward runs the whole inner backward);
    partition_activations needs block inputs equal over a TP group: tp > 1 without SP."""
    parallel, options = LAYOUTS[layout][1], POLICIES.get(policy, {})
    if options.get("use_reentrant") and parallel.get("pipeline_schedule") == "zb_h1":
        return True
    return options.get("partition_activations", False) and (parallel.get("tensor", 1) == 1
                                                             or parallel.get("sequence_parallel", False))


def gpt(dropout: float, n_layer: int) -> GPT:
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=n_layer, n_head=6, n_kv_head=2, d_model=12,
                    ffn_hidden=20, tie_embeddings=True, dropout=dropout, attn_impl="math")
    return GPT(cfg, seed=5, dtype=torch.float64)


def rows(layout: str) -> int:
    """Two micro-batches of one row per dp rank: one process then draws the same dropout masks."""
    world, parallel = LAYOUTS[layout][:2]
    return 2 * world // (parallel.get("tensor", 1) * parallel.get("context", 1) * parallel.get("pipeline", 1))


def config(layout: str, ac: dict | None = None, reference: bool = False) -> dict:
    _, parallel, stage, _, _, clip, _ = LAYOUTS[layout]
    return {"train_batch_size": rows(layout), "train_micro_batch_size_per_gpu": 1, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}},
            "zero_optimization": {"stage": 0 if reference else stage},
            "activation_checkpointing": ac or {"policy": "none"}, "parallel": {} if reference else parallel}


def batches(layout: str):
    return synthetic_token_batches(num_batches=STEPS, batch_size=rows(layout), seq_len=SEQ, vocab_size=VOCAB, seed=3)


def _train(cases: list[tuple[str, str]]) -> list:
    """On each rank: each (layout, policy) trained by a fresh engine from the same generators;
    its losses, full state, policy per block and the last step's all-gathers (op, bytes)."""
    out = []
    for layout, policy in cases:
        _, _, _, dropout, n_layer, _, _ = LAYOUTS[layout]
        model = gpt(dropout, n_layer)  # (its nn.Linear init draws from the global RNG)
        torch.manual_seed(DROPOUT_SEED + 1000 * dist.get_rank())  # only rank 0's may matter
        engine = ts.initialize(model, config(layout, POLICIES.get(policy)))
        losses = []
        for b in batches(layout):
            engine.comm_ledger.clear()
            losses.append(engine.train_batch(b))
        gathers = [row.bytes for row in engine.comm_ledger.rows if row.op == "all_gather"]
        out.append((losses, engine.full_state_dict(), policy_of(engine.model), gathers))
    return out


def cases(layouts: list[str], thorough: bool) -> tuple[tuple[str, str], ...]:
    return tuple((name, policy) for name in layouts
                 for policy in ("none", *(POLICIES if thorough else LAYOUTS[name][6]))
                 if not refused(name, policy))


@functools.cache
def results(world: int, thorough: bool) -> dict:
    todo = cases([n for n, spec in LAYOUTS.items() if spec[0] == world], thorough)
    per_rank = run_on_ranks(_train, world, list(todo))
    return {case: [r[i] for r in per_rank] for i, case in enumerate(todo)}


@functools.cache
def reference(layout: str):
    _, _, _, dropout, n_layer, _, _ = LAYOUTS[layout]
    model = gpt(dropout, n_layer)
    torch.manual_seed(DROPOUT_SEED)
    losses = ts.reference.train(model, batches(layout), config(layout, reference=True))
    return losses, model.state_dict()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_activation_checkpointing_is_bit_identical_to_none(layout, pytestconfig):
    world = LAYOUTS[layout][0]
    thorough = pytestconfig.getoption("--thorough")
    got = results(world, thorough)
    plain = got[(layout, "none")]
    policies = [p for _, p in cases([layout], thorough) if p != "none"]
    assert policies
    for policy in policies:
        kinds = [k for _, _, rank_kinds, _ in got[(layout, policy)] for k in rank_kinds]
        assert any(k not in ("plain", "elsewhere") for k in kinds), (layout, policy, kinds)  # applied somewhere
        for rank, ((losses, state, _, _), (ref_losses, ref_state, _, _)) in enumerate(zip(got[(layout, policy)],
                                                                                         plain)):
            assert losses == ref_losses, (layout, policy, rank)
            assert list(state) == list(ref_state)
            different = [k for k in state if not torch.equal(state[k], ref_state[k])]
            assert not different, (layout, policy, rank, different)
    if LAYOUTS[layout][1].get("tensor_dropout") == "tracker":
        return  # the tracker's masks are not one process's
    expected_losses, expected = reference(layout)
    for losses, state, _, _ in got[(layout, policies[0])]:
        assert_losses_close(losses, expected_losses)
        assert_state_dicts_close(state, expected, what=f"{layout} with {policies[0]} after {STEPS} steps")


def test_layout_activation_checkpointing_reentrant_with_zero_bubble_is_refused():
    """Zero-bubble's B pass takes the input gradient alone (torch.autograd.grad with inputs);
    a re-entrant checkpoint's backward runs the whole inner backward, so it cannot be split."""
    for policy in ("full-reentrant", "selective-reentrant"):
        with pytest.raises(ts.ConfigError, match="use_reentrant") as err:
            check_supported(ts.EngineConfig.load(config("pp2-zb_h1", POLICIES[policy])))
        assert "zb_h1" in str(err.value)
    check_supported(ts.EngineConfig.load(config("pp2-1f1b", POLICIES["full-reentrant"])))  # 1F1B takes it


@pytest.mark.parametrize(("layout", "local_len"), [("tp2-tracker", SEQ), ("tp2-cp2", 12), ("pp2-tp2", SEQ)])
def test_layout_activation_checkpointing_partition_activations_gathers_each_checkpointed_input(layout, local_len,
                                                                                                pytestconfig):
    """partition_activations: each rank keeps 1/t of a checkpointed block's input, so backward
    all-gathers it once per checkpointed block and micro-batch, (1 row, local_len, C) float64 in
    all (cp: 22 tokens padded to 24, 12 per rank); without the option no all-gather runs (tensor
    parallelism has none without SP). A later pipeline stage's first input is the received
    activation, which the executor holds whole anyway: kept whole, not gathered."""
    got = results(LAYOUTS[layout][0], pytestconfig.getoption("--thorough"))
    policy = next(p for _, p in cases([layout], False) if POLICIES.get(p, {}).get("partition_activations"))
    for (_, _, kinds, gathers), (_, _, _, plain_gathers) in zip(got[(layout, policy)], got[(layout, "none")]):
        assert plain_gathers == []
        first_here = next(i for i, k in enumerate(kinds) if k != "elsewhere")
        split = kinds.count("checkpointed") - (first_here > 0 and kinds[first_here] == "checkpointed")
        micro_batches = 2  # one row each
        assert gathers == [local_len * 12 * 8] * (split * micro_batches), (kinds, gathers)


@pytest.mark.parametrize(("ac", "parallel", "names"), [
    ({"policy": "selective", "partition_activations": True}, {"tensor": 2}, ["partition_activations", "'full'"]),
    ({"policy": "offload", "cpu_checkpointing": True}, {"tensor": 2}, ["cpu_checkpointing", "'offload'"]),
    ({"policy": "full", "partition_activations": True}, {}, ["partition_activations", "parallel.tensor > 1"]),
    ({"policy": "full", "partition_activations": True}, {"tensor": 2, "sequence_parallel": True},
     ["partition_activations", "sequence shard"]),
], ids=["partition_with_selective", "cpu_checkpointing_with_offload", "partition_without_tp", "partition_with_sp"])
def test_layout_activation_checkpointing_deepspeed_options_refused_where_they_mean_nothing(ac, parallel, names):
    with pytest.raises(ts.ConfigError) as err:
        check_supported(ts.EngineConfig.load({"train_batch_size": 2, "activation_checkpointing": ac,
                                              "parallel": parallel}))
    for name in names:
        assert name in str(err.value), (name, str(err.value))
