"""The GPT made tensor-parallel (and sequence-parallel) trains like one process, and talks as Megatron says.

- trained a few steps with SGD and AdamW (gradient accumulation of 2 micro-batches), tp = 2, 3
  and 4, with and without sequence parallelism, GQA, tied and untied head, a vocab (251) no
  degree divides: losses and the gathered parameters equal `tinyscale.reference.train`'s
  (float64, rtol 1e-10);
- the comm ledger of one forward and one backward equals the formula per block;
- `full_state_dict_from_tp` gives back the original keys and tensors exactly;
- bad layouts are refused with the numbers and the fix.
Run: `pytest tests/tensor_parallel -k "tp_gpt or tp_ledger"`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.dist import ParallelMesh, comm
from tinyscale.models import GPT, GPTConfig
from tinyscale.tensor_parallel import apply_tensor_parallel, check_tensor_parallel, full_state_dict_from_tp
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks

VOCAB = 251  # prime: padded on every degree

OPTIMIZERS = {  # SGD too: Adam hides a uniform gradient-scale bug (a missing or doubled all-reduce)
    "adamw": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}},
    "sgd": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}},
}


def gpt_config(tp: int, tied: bool, n_layer: int = 2) -> GPTConfig:
    """Heads that split over tp, K/V heads too (GQA with groups of 2 or 3 query heads)."""
    heads, kv = {2: (6, 2), 3: (6, 3), 4: (8, 4)}[tp]
    return GPTConfig(vocab_size=VOCAB, max_seq_len=16, n_layer=n_layer, n_head=heads, n_kv_head=kv,
                     d_model=4 * heads, ffn_hidden=12 * tp, tie_embeddings=tied)


def _run_config(optimizer: str) -> dict:
    return {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "optimizer": OPTIMIZERS[optimizer]}


def _batches(steps: int, seq_len: int = 12):
    return synthetic_token_batches(num_batches=steps, batch_size=4, seq_len=seq_len, vocab_size=VOCAB, seed=3)


def train_tp_body(tied: bool, sequence_parallel: bool, optimizer: str, steps: int):
    """Every rank: the full GPT, split in place, trained by the plain single-process loop."""
    tp = dist.get_world_size()
    model = GPT(gpt_config(tp, tied), seed=5, dtype=torch.float64)
    apply_tensor_parallel(model, ParallelMesh(tp=tp), sequence_parallel=sequence_parallel)
    # The loop of reference.train: every rank of a TP group sees the whole batch; only the
    # parameters and activations are split. No gradient clipping (it would need a TP-aware norm).
    losses = ts.reference.train(model, _batches(steps), _run_config(optimizer))
    return losses, full_state_dict_from_tp(model)


def _layout_id(tp, sequence_parallel, *rest) -> str:
    """Test ids carry the keys: `-k sequence_parallel` selects the SP runs."""
    return "-".join([f"tp{tp}", "sequence_parallel" if sequence_parallel else "no_sp", *map(str, rest)])


LAYOUTS = [(2, False, "sgd", "tied"), (2, True, "adamw", "untied"), (3, False, "adamw", "tied"),
           (3, True, "sgd", "untied"), (4, True, "sgd", "tied")]


@pytest.mark.parametrize(("tp", "sequence_parallel", "optimizer", "tied"),
                         [pytest.param(tp, sp, opt, tie == "tied", id=_layout_id(tp, sp, opt, tie))
                          for tp, sp, opt, tie in LAYOUTS])
def test_tp_gpt_trains_like_single_process(tp, sequence_parallel, optimizer, tied):
    steps = 3
    results = run_on_ranks(train_tp_body, tp, tied, sequence_parallel, optimizer, steps)
    reference = GPT(gpt_config(tp, tied), seed=5, dtype=torch.float64)
    expected_losses = ts.reference.train(reference, _batches(steps), _run_config(optimizer))
    expected = reference.state_dict()
    for losses, state in results:
        assert_losses_close(losses, expected_losses)
        assert_state_dicts_close(state, expected, what=f"tp={tp} sp={sequence_parallel} vs one process")
    assert expected_losses[-1] < expected_losses[0]  # it trained: the comparison is not of a frozen model


def ledger_body(sequence_parallel: bool, n_layer: int):
    tp = dist.get_world_size()
    model = GPT(gpt_config(tp, tied=False, n_layer=n_layer), seed=5, dtype=torch.float64)
    apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=sequence_parallel)
    idx, targets = _batches(1)[0]
    with comm.record() as forward:
        loss = model(idx, targets)
    with comm.record() as backward:
        loss.backward()
    return [{op: (ledger.calls(op), ledger.bytes(op)) for op in ("all_reduce", "all_gather", "reduce_scatter")}
            for ledger in (forward, backward)]


@pytest.mark.parametrize(("tp", "sequence_parallel"), [pytest.param(2, False, id=_layout_id(2, False)),
                                                       pytest.param(3, True, id=_layout_id(3, True))])
def test_tp_ledger_matches_megatron_formula(tp, sequence_parallel):
    """Per block: 2 all-reduces of (B, T, C) forward (after wo, after w_down) and 2 backward
    (f before q/k/v, before gate/up). Plus the embedding's g forward, the head's f backward, and
    the loss's 3 all-reduces of one number per token (max, target logit, sum of exps).
    With SP each (B, T, C) all-reduce becomes an all-gather and a reduce-scatter of the same size
    (an all-reduce's two halves), and each norm's weight gradient (C numbers) is all-reduced."""
    L = 3
    (forward, backward), *_ = run_on_ranks(ledger_body, tp, sequence_parallel, L)
    cfg = gpt_config(tp, tied=False)
    B, T, C, f64 = 4, 12, cfg.d_model, 8
    act, tokens = B * T * C * f64, B * T * f64  # bytes of one (B, T, C) activation; of one number per token
    if not sequence_parallel:
        assert forward == {"all_reduce": (2 * L + 1 + 3, (2 * L + 1) * act + 3 * tokens),
                           "all_gather": (0, 0), "reduce_scatter": (0, 0)}
        assert backward == {"all_reduce": (2 * L + 1, (2 * L + 1) * act), "all_gather": (0, 0),
                            "reduce_scatter": (0, 0)}
    else:
        norms = 2 * L + 1
        assert forward == {"all_reduce": (3, 3 * tokens), "all_gather": (2 * L + 1, (2 * L + 1) * act),
                           "reduce_scatter": (2 * L + 1, (2 * L + 1) * act)}
        assert backward == {"all_reduce": (norms, norms * C * f64), "all_gather": (2 * L + 1, (2 * L + 1) * act),
                            "reduce_scatter": (2 * L + 1, (2 * L + 1) * act)}


def state_dict_body(tied: bool, sequence_parallel: bool):
    """Split then gather back: the same keys and tensors, bit for bit; logits equal too; frozen
    parameters (column, row, embedding) stay frozen."""
    tp = dist.get_world_size()
    reference = GPT(gpt_config(tp, tied), seed=5, dtype=torch.float64)
    model = GPT(gpt_config(tp, tied), seed=5, dtype=torch.float64)
    for frozen in (model.blocks[0].mlp.w_up.weight, model.blocks[1].attn.wo.weight, model.embed.weight):
        frozen.requires_grad_(False)
    apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=sequence_parallel)
    frozen = sorted(name for name, p in model.named_parameters() if not p.requires_grad)
    local_rows = model.embed.weight.shape[0]
    full = full_state_dict_from_tp(model, dist.group.WORLD)
    idx, _ = _batches(1)[0]
    logits_diff = (model(idx) - reference(idx)).abs().max().item()
    try:
        model(idx[:, :7], idx[:, :7])
        odd_t = "accepted"
    except ValueError as exc:
        odd_t = str(exc)
    return (list(full), {k: torch.equal(v, reference.state_dict()[k]) for k, v in full.items()},
            list(reference.state_dict()), local_rows, logits_diff, odd_t, frozen)


@pytest.mark.parametrize(("tied", "sequence_parallel"), [pytest.param(True, True, id="tied-sequence_parallel"),
                                                         pytest.param(False, False, id="untied-no_sp")])
def test_tp_gpt_full_state_dict_is_the_original(tied, sequence_parallel):
    tp = 3
    for keys, equal, expected_keys, local_rows, logits_diff, odd_t, frozen in run_on_ranks(
            state_dict_body, tp, tied, sequence_parallel):
        assert keys == expected_keys
        assert frozen == ["blocks.0.mlp.w_up.weight", "blocks.1.attn.wo.weight", "embed.weight"]  # stay frozen
        assert all(equal.values()), [k for k, ok in equal.items() if not ok]
        assert local_rows == -(-VOCAB // tp)  # ceil(251/3) = 84 rows per rank, 1 of padding
        assert logits_diff < 1e-12  # float64 logits, reduced in another order: ~1e-16 noise
        if sequence_parallel:
            assert "T=7" in odd_t and "tp=3" in odd_t
        else:
            assert odd_t == "accepted"


@pytest.mark.parametrize(("changes", "tp", "words"), [
    ({"n_head": 6, "d_model": 24}, 4, ["n_head", "6", "tp=4"]),
    ({"n_head": 6, "n_kv_head": 3, "d_model": 24}, 2, ["n_kv_head", "3", "tp=2"]),
    ({"ffn_hidden": 10}, 4, ["ffn_hidden", "10", "tp=4"]),
    ({"n_head": 6, "n_kv_head": 2, "d_model": 24}, 3, ["n_kv_head", "2", "tp=3"]),  # 2 neither divides nor is divided by 3
])
def test_tp_gpt_rejects_layouts_it_cannot_split(changes, tp, words):
    cfg = GPTConfig(n_head=4, d_model=16, ffn_hidden=12).with_(**changes)
    with pytest.raises(ValueError) as info:
        check_tensor_parallel(cfg, tp)
    for word in words:
        assert word in str(info.value)
    check_tensor_parallel(GPTConfig(n_head=4, d_model=16, ffn_hidden=12), 4)  # the base config splits


def mesh_body():
    """dp=2 x tp=2: each TP group splits the model over its 2 ranks and takes its own rows."""
    mesh = ParallelMesh(dp=2, tp=2)
    cfg = gpt_config(2, tied=True)
    idx, targets = _batches(1)[0]
    rows = slice(2 * mesh.rank("dp"), 2 * mesh.rank("dp") + 2)  # this dp rank's 2 of the 4 rows
    dense = GPT(cfg, seed=5, dtype=torch.float64)
    dense_loss = dense(idx[rows], targets[rows])
    dense_loss.backward()
    model = apply_tensor_parallel(GPT(cfg, seed=5, dtype=torch.float64), mesh, sequence_parallel=True)
    with comm.record() as ledger:
        loss = model(idx[rows], targets[rows])
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        owner = model.get_submodule(name.rpartition(".")[0])
        grads[name] = owner.full_tensor(name.rpartition(".")[2], p.grad) if hasattr(owner, "full_tensor") else p.grad
    expected = {name: p.grad for name, p in dense.named_parameters()}
    full = full_state_dict_from_tp(model, mesh)
    try:
        full_state_dict_from_tp(model, dist.group.WORLD)
        wrong_group = "accepted"
    except ValueError as exc:
        wrong_group = str(exc)
    return (loss.item(), dense_loss.item(), grads, expected, {row.group_size for row in ledger.rows},
            full, dense.state_dict(), wrong_group)


def test_tp_gpt_on_a_dp_tp_mesh_talks_only_within_its_tp_group():
    """Every collective goes over the 2-rank TP group (never the 4-rank world), each TP group
    computes the dense loss and gradients of its own rows, and full_state_dict_from_tp takes the
    mesh and refuses a group the model was not split over."""
    for loss, dense_loss, grads, expected, group_sizes, full, dense_state, wrong_group in run_on_ranks(mesh_body, 4):
        assert_losses_close([loss], [dense_loss])
        assert_state_dicts_close(grads, expected, what="grads on a dp x tp mesh")
        assert group_sizes == {2}
        assert_state_dicts_close(full, dense_state, what="full_state_dict_from_tp(model, mesh)")
        assert "ranks [0, 1, 2, 3]" in wrong_group
