"""The GPT made context-parallel (`apply_context_parallel`) trains exactly like one process
(`tinyscale.reference.train`, float64, rtol 1e-10): ring and Ulysses, zigzag and
contiguous, cp 2 and 3, GQA, tied embeddings, lengths that need padding.
Run: `pytest -k cp_gpt`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.config import EngineConfig
from tinyscale.context_parallel.apply import apply_context_parallel, reduce_cp_grads, shard_batch
from tinyscale.context_parallel.sharding import Layout, unshard
from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig
from tinyscale.optim import lr_at, optimizer_factory, set_lr
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks

# 6 query heads over 2 K/V heads (GQA): Ulysses splits the K/V heads on 2 ranks and
# replicates them on 3. max_seq_len 16: a padded 16-token row runs past the RoPE table.
CFG = GPTConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=6, n_kv_head=2, d_model=36, ffn_hidden=48,
                tie_embeddings=True)
CONFIG = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
STEPS = 3


def _batches(T, seed=0):
    return synthetic_token_batches(num_batches=STEPS, batch_size=2, seq_len=T, vocab_size=CFG.vocab_size, seed=seed)


# --8<-- [start:train-cp]
def train_cp(algorithm, sharding, T):
    """On each rank of the CP group: the model on its shard of every row, the reference's
    optimizer, gradients summed over the group before each step."""
    model = GPT(CFG, seed=1, dtype=torch.float64)
    apply_context_parallel(model, None, algorithm=algorithm, sharding=sharding)
    config = EngineConfig.load(CONFIG)
    optimizer = optimizer_factory(config)([p for p in model.parameters() if p.requires_grad])
    losses = []
    for step, batch in enumerate(_batches(T)):
        loss = model(*shard_batch(batch, None, sharding))  # the full rows' mean loss, on every rank
        loss.backward()
        reduce_cp_grads(model, None)  # each rank holds its tokens' share of the gradient
        set_lr(optimizer, lr_at(step, config))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}
# --8<-- [end:train-cp]


def _reference(T):
    model = GPT(CFG, seed=1, dtype=torch.float64)
    losses = ts.reference.train(model, _batches(T), CONFIG)
    return losses, {k: v.detach() for k, v in model.named_parameters()}


CASES = [  # (cp, algorithm, sharding, T)
    (2, "ring", "zigzag", 16),
    (3, "ring", "zigzag", 16),  # padded to 18: positions 16, 17 past the RoPE table
    (2, "ring", "contiguous", 15),
    (3, "ulysses", "zigzag", 13),
    (2, "ulysses", "contiguous", 16),
]


@pytest.mark.parametrize(("cp", "algorithm", "sharding", "T"), CASES)
def test_cp_gpt_trains_like_one_process_float64(cp, algorithm, sharding, T):
    results = run_on_ranks(train_cp, cp, algorithm, sharding, T)
    expected_losses, expected = _reference(T)
    for losses, params in results:
        assert_losses_close(losses, expected_losses)  # every rank returns the full rows' loss
        assert_state_dicts_close(params, expected, what=f"cp={cp} {algorithm} {sharding} vs one process")


def _logits_body(algorithm, sharding, T):
    model = GPT(CFG, seed=2, dtype=torch.float64)
    idx = _batches(T, seed=4)[0][0]
    full = model(idx)  # (B, T, V) before the swap
    before = model.state_dict(keep_vars=True)
    apply_context_parallel(model, None, algorithm=algorithm, sharding=sharding)
    after = model.state_dict(keep_vars=True)  # the transform adds no parameter or buffer: checkpoints need no inverse
    assert list(after) == list(before) and all(after[k] is before[k] for k in before)
    inputs, _ = shard_batch((idx, idx), None, sharding)
    return full, model(inputs)  # (B, Tl, V) this rank's positions


@pytest.mark.parametrize(("algorithm", "sharding"), [("ring", "zigzag"), ("ulysses", "contiguous")])
def test_cp_gpt_logits_of_the_shards_are_the_full_models(algorithm, sharding):
    results = run_on_ranks(_logits_body, 3, algorithm, sharding, 11)
    full = results[0][0]
    got = unshard([shard_logits for _, shard_logits in results], Layout(3, sharding, 11), dim=1)
    torch.testing.assert_close(got, full, rtol=1e-10, atol=1e-12)  # float64: summation order only


def _refusal_body(kwargs, dropout):
    model = GPT(CFG.with_(dropout=dropout), seed=0, dtype=torch.float64)
    try:
        apply_context_parallel(model, None, **kwargs)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(("world", "kwargs", "dropout", "message"), [
    (4, {"algorithm": "ulysses"}, 0.0, "n_head=6 % cp=4 = 2"),
    (2, {"algorithm": "tree"}, 0.0, "algorithm='tree' is unknown"),
    (2, {"sharding": "striped"}, 0.0, "sharding='striped' is unknown"),
    (2, {}, 0.1, "dropout_masks='counter'"),  # stream masks refused; counter masks: -k layout_dropout
])
def test_cp_gpt_refuses_what_it_cannot_serve(world, kwargs, dropout, message):
    for text in run_on_ranks(_refusal_body, world, kwargs, dropout):
        assert message in text


def test_cp_gpt_rejects_rows_too_long_for_the_rope_table():
    """A shard of 6 positions on 4 zigzag ranks: 24 padded, at least 17 real > max_seq_len 16."""
    results = run_on_ranks(_too_long_body, 4)
    assert all("longer than max_seq_len=16" in r for r in results)


def _too_long_body():
    model = apply_context_parallel(GPT(CFG, seed=0, dtype=torch.float64), None)
    try:
        model(torch.zeros(1, 6, dtype=torch.long))
    except ValueError as exc:
        return str(exc) + f" (rank {dist.get_rank()})"
    return "no error"


def _ledger_body(algorithm, T):
    from tinyscale.dist import comm

    model = apply_context_parallel(GPT(CFG, seed=0, dtype=torch.float64), None, algorithm=algorithm)
    batch = shard_batch(_batches(T)[0], None, "zigzag")
    with comm.record() as fwd:
        loss = model(*batch)
    with comm.record() as bwd:
        loss.backward()
    return fwd.by_op(), bwd.by_op()


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_gpt_ring_attention_ledger_per_layer(cp):
    """Per rank: each of the n_layer layers sends cp-1 K/V blocks forward (2 B Tl K D e bytes,
    K = 2 K/V heads, not the 6 query heads) and cp-1 K/V plus cp-1 dK/dV blocks backward;
    the loss costs one all-reduce of (sum, count)."""
    B, T, e = 2, 16, 8
    Tl = Layout(cp, "zigzag", T).local_len
    block = 2 * B * Tl * CFG.kv_heads * CFG.head_dim * e
    for fwd, bwd in run_on_ranks(_ledger_body, cp, "ring", T):
        assert fwd["isend"]["calls"] == CFG.n_layer * (cp - 1)
        assert fwd["isend"]["bytes"] == CFG.n_layer * (cp - 1) * block
        assert fwd["all_reduce"]["calls"] == 1 and fwd["all_reduce"]["bytes"] == 2 * e
        assert bwd["isend"]["bytes"] == CFG.n_layer * 2 * (cp - 1) * block
        assert set(bwd) == {"isend", "irecv"}


def test_cp_gpt_ulysses_ledger_per_layer():
    """Per rank: 4 all-to-alls per layer forward, q and out B H Tl D e bytes, k and v
    B K Tl D e (cp 2 divides the 2 K/V heads: no replication); 4 more backward."""
    B, T, e, cp = 2, 16, 8, 2
    Tl = Layout(cp, "zigzag", T).local_len
    q_bytes, kv_bytes = B * CFG.n_head * Tl * CFG.head_dim * e, B * CFG.kv_heads * Tl * CFG.head_dim * e
    for fwd, bwd in run_on_ranks(_ledger_body, cp, "ulysses", T):
        assert fwd["all_to_all"]["calls"] == 4 * CFG.n_layer
        assert fwd["all_to_all"]["bytes"] == CFG.n_layer * (2 * q_bytes + 2 * kv_bytes)
        assert bwd["all_to_all"]["calls"] == 4 * CFG.n_layer
        assert bwd["all_to_all"]["bytes"] == CFG.n_layer * (2 * q_bytes + 2 * kv_bytes)
