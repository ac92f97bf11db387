"""Counter dropout masks (`tinyscale.models.dropout`, `GPTConfig.dropout_masks="counter"`).

- the mask is a pure function of the coordinates: any block of coordinates, in any order,
  gives that block of the full mask, call after call (also a hypothesis property over sizes,
  subsets, p and keys); another step, layer, site or seed another mask;
- its keep-rate is 1 - p and the dropped tensor's mean is preserved, within a binomial bound;
  neighbouring elements are kept independently (pairs kept at rate (1 - p)^2);
- the GPT with counter masks: a micro-batch of rows told its global first row, and a prefix of
  the sequence, compute exactly the full batch's outputs there (stream masks do not);
- the masks' seed is `GPTConfig.dropout_seed`, not the weights' init seed;
- full and selective activation checkpointing are bit-identical to none under
  `tinyscale.reference.train` with accumulation (the recomputation redraws the same masks).
The engine in every layout: tests/engine/test_layout_dropout.py.
Run: `pytest tests/models/test_counter_dropout.py` (key counter_dropout).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tinyscale as ts
from tinyscale.checkpointing import apply_policy
from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig
from tinyscale.models.dropout import (
    SITE_ATTN, SITE_MLP, SITE_PROBS, DropoutClock, keep_mask, residual_dropout, set_dropout_clock, site_key,
)

SIGMAS = 6  # a bound of 6 standard deviations: a correct hash fails it with probability ~2e-9


def _grid(*sizes: int) -> list[torch.Tensor]:
    """arange(n) per size, each along its own axis of a len(sizes)-dim tensor."""
    out = []
    for axis, n in enumerate(sizes):
        shape = [1] * len(sizes)
        shape[axis] = n
        out.append(torch.arange(n).view(shape))
    return out


def test_counter_dropout_mask_is_a_pure_function_of_coordinates():
    key = site_key(seed=3, step=5, layer=1, site=SITE_PROBS)
    full = keep_mask(0.3, key, *_grid(5, 4, 13, 13))  # (rows, heads, queries, keys)
    assert torch.equal(full, keep_mask(0.3, key, *_grid(5, 4, 13, 13)))  # the same bits, call after call
    rows, heads, q, k = torch.tensor([3, 1]), torch.tensor([2]), torch.tensor([12, 0, 7]), torch.arange(4, 11)
    block = keep_mask(0.3, key, rows[:, None, None, None], heads[None, :, None, None], q[None, None, :, None],
                      k[None, None, None, :])
    assert torch.equal(block, full[rows][:, heads][:, :, q][:, :, :, k])  # any slicing, any order
    for other in (site_key(3, 6, 1, SITE_PROBS), site_key(3, 5, 2, SITE_PROBS), site_key(3, 5, 1, SITE_ATTN),
                  site_key(4, 5, 1, SITE_PROBS)):  # another step, layer, site, seed
        assert not torch.equal(full, keep_mask(0.3, other, *_grid(5, 4, 13, 13)))


@st.composite
def _blocks(draw):
    """A grid of (rows, heads, queries, keys) sizes, and a subset of each axis in any order."""
    sizes = [draw(st.integers(1, n)) for n in (5, 4, 9, 9)]
    picks = [draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True)) for n in sizes]
    return sizes, picks, draw(st.floats(0.0, 0.95)), draw(st.integers(-2**63, 2**63 - 1))


@given(_blocks())
def test_counter_dropout_property_any_block_is_that_block_of_the_full_mask(block):
    sizes, picks, p, key = block
    full = keep_mask(p, key, *_grid(*sizes))
    coords = [torch.tensor(pick).view([-1 if i == axis else 1 for i in range(4)]) for axis, pick in enumerate(picks)]
    expected = full[torch.tensor(picks[0])][:, picks[1]][:, :, picks[2]][:, :, :, picks[3]]
    assert torch.equal(keep_mask(p, key, *coords), expected)


def test_counter_dropout_sequence_shards_are_slices_of_the_full_mask():
    h = torch.ones(3, 12, 8, dtype=torch.float64)
    clock = DropoutClock(seed=1, step=2, row0=6)
    full = residual_dropout(h, 0.4, clock, layer=0, site=SITE_MLP)
    shards = [residual_dropout(h[:, :4], 0.4, clock, layer=0, site=SITE_MLP, sequence_shard=(r, 3))
              for r in range(3)]
    assert torch.equal(torch.cat(shards, dim=1), full)
    clock.positions = torch.arange(12).flip(0)  # context parallelism: the tokens' global positions
    assert torch.equal(residual_dropout(h, 0.4, clock, layer=0, site=SITE_MLP), full.flip(1))
    clock.positions, clock.row0 = None, 7  # rows 7..9: rows 1..2 of the first call are its rows 0..1
    assert torch.equal(residual_dropout(h, 0.4, clock, layer=0, site=SITE_MLP)[:2], full[1:])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_counter_dropout_keep_rate_and_mean_within_binomial_bound(p):
    B, T, C = 16, 256, 256
    N = B * T * C  # 2^20 elements
    out = residual_dropout(torch.ones(B, T, C, dtype=torch.float64), p, DropoutClock(seed=9, step=1), 2, SITE_ATTN)
    kept = int((out != 0).sum())
    # Kept ~ Binomial(N, 1 - p) if the hash bits are independent and uniform: sd sqrt(N p (1 - p))
    assert abs(kept - N * (1 - p)) <= SIGMAS * math.sqrt(N * p * (1 - p)), (kept, N * (1 - p))
    # the mean is kept / (N (1 - p)): 1 within the same bound divided by N (1 - p)
    assert abs(out.mean().item() - 1.0) <= SIGMAS * math.sqrt(p / (N * (1 - p)))
    # neighbours are independent: disjoint pairs of adjacent features both kept ~ Binomial(N/2, (1 - p)^2)
    pairs, q = N // 2, (1 - p) ** 2
    both = int(((out[..., 0::2] != 0) & (out[..., 1::2] != 0)).sum())
    assert abs(both - pairs * q) <= SIGMAS * math.sqrt(pairs * q * (1 - q)), (both, pairs * q)
    assert set(out.unique().tolist()) == {0.0, 1 / (1 - p)}  # kept elements scaled by 1 / (1 - p)


def _gpt(masks: str, n_layer: int = 2) -> GPT:
    cfg = GPTConfig(vocab_size=29, max_seq_len=12, n_layer=n_layer, n_head=4, n_kv_head=2, d_model=16,
                    ffn_hidden=24, dropout=0.2, dropout_masks=masks)
    return GPT(cfg, seed=1, dtype=torch.float64).train()


def test_counter_dropout_gpt_outputs_depend_on_global_rows_and_positions_only():
    idx = synthetic_token_batches(num_batches=1, batch_size=4, seq_len=12, vocab_size=29, seed=0)[0][0]
    model = _gpt("counter")
    set_dropout_clock(model, step=3, row0=0)
    full = model(idx)  # (4, 12, V) logits, training mode: dropped
    set_dropout_clock(model, step=3, row0=2)
    # float64, the same ops on fewer rows or positions: only matmul blocking may differ (~1e-16)
    torch.testing.assert_close(model(idx[2:]), full[2:], rtol=1e-12, atol=1e-14)
    set_dropout_clock(model, step=3, row0=0)
    torch.testing.assert_close(model(idx[:, :7]), full[:, :7], rtol=1e-12, atol=1e-14)  # causal: a prefix
    set_dropout_clock(model, step=4, row0=0)
    assert not torch.allclose(model(idx), full)  # the next step: other masks
    stream = _gpt("stream")
    torch.manual_seed(0)
    stream_full = stream(idx)
    torch.manual_seed(0)
    assert not torch.allclose(stream(idx[2:]), stream_full[2:])  # a stream's masks follow the call's shape


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_counter_dropout_checkpointing_is_bit_identical(policy):
    data = synthetic_token_batches(num_batches=2, batch_size=4, seq_len=12, vocab_size=29, seed=2)
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    runs = []
    for model in (_gpt("counter", 3), apply_policy(_gpt("counter", 3), policy)):
        runs.append((ts.reference.train(model, data, config), model.state_dict()))
    (plain_losses, plain), (ckpt_losses, ckpt) = runs
    assert ckpt_losses == plain_losses
    assert all(torch.equal(ckpt[k], plain[k]) for k in plain)


def test_counter_dropout_seed_is_the_configs_not_the_inits():
    idx = synthetic_token_batches(num_batches=1, batch_size=2, seq_len=12, vocab_size=29, seed=0)[0][0]
    model, other = _gpt("counter"), GPT(_gpt("counter").config, seed=9, dtype=torch.float64).train()
    other.load_state_dict(model.state_dict())  # built from another seed, then given the same weights
    assert torch.equal(other(idx), model(idx))  # (a checkpoint loaded into it draws the same masks)
    reseeded = GPT(model.config.with_(dropout_seed=1), seed=1, dtype=torch.float64).train()
    assert not torch.allclose(reseeded(idx), model(idx))


def test_counter_dropout_config_names_the_field():
    with pytest.raises(ValueError, match="GPTConfig.dropout_masks='philox'"):
        GPTConfig(dropout=0.1, dropout_masks="philox")
