"""Saved activation bytes, measured with saved-tensor hooks, against the per-layer formula.

Korthikanti et al.'s sbh(34 + 5as/h), adapted to our Llama-style block in formula.py:

    p [(10 + 2d) sbh + 4 sbF + 2 sb + (1 + 2d) a s^2 b] + s^2      ("math" attention, CPU)

p = 4 (float32) or 8 (float64) bytes, d = 1 with dropout; "sdpa" drops the s^2 causal mask,
and without dropout its fused kernel keeps a s b log-sum-exp elements instead of the s^2
terms. Under bf16 and fp16 (p = 2) the block computes its norms and softmax in float32, so
those tensors are 4 bytes (u = 4 in formula.py): the norms' inputs and 1/rms, the softmax or
log-sum-exp, and with "sdpa" and dropout torch's CPU fallback's q, k, v and core. A GPT built in
bf16 saves what the engine's bf16 does (it casts the parameters, keeps the float32 RoPE tables;
tests/planner/test_planner_bf16.py measures the engine itself). The margin is **zero bytes**:
the formula names every tensor autograd saves, so a torch upgrade that changes what an op saves
fails here (and the lesson's table with it).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tinyscale.checkpointing import (
    apply_policy,
    block_saved_bytes,
    checkpoint,
    korthikanti_layer_bytes,
    model_saved_bytes_drop,
    peak_bytes,
    saved_bytes,
    saved_tensors,
)
from tinyscale.models import GPT, GPTConfig

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@st.composite
def configs(draw) -> GPTConfig:
    n_head = draw(st.sampled_from([1, 2, 4]))
    return GPTConfig(vocab_size=64, max_seq_len=24, n_layer=draw(st.integers(1, 4)), n_head=n_head,
                     n_kv_head=draw(st.sampled_from([k for k in (1, 2, 4) if n_head % k == 0])),
                     d_model=n_head * draw(st.sampled_from([2, 4, 8])), ffn_hidden=draw(st.sampled_from([None, 24])),
                     dropout=draw(st.sampled_from([0.0, 0.1])), attn_impl=draw(st.sampled_from(["math", "sdpa"])))


def tokens(cfg, batch, seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (batch, seq), generator=g),
            torch.randint(0, cfg.vocab_size, (batch, seq), generator=g))


@pytest.mark.parametrize("dtype", DTYPES)
@given(cfg=configs(), batch=st.integers(1, 4), seq=st.integers(1, 24))
def test_activation_checkpoint_block_saved_bytes_equal_formula(dtype, cfg, batch, seq):
    model = GPT(cfg, dtype=dtype).train()
    x = torch.randn(batch, seq, cfg.d_model, dtype=dtype, requires_grad=True)
    measured = saved_bytes(model.blocks[0], x, model.rope_cos[:seq], model.rope_sin[:seq], exclude_state_of=model)
    assert measured == block_saved_bytes(cfg, batch, seq, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("attn", "dropout"), [("sdpa", 0.0), ("sdpa", 0.1), ("math", 0.0), ("math", 0.1)])
def test_activation_checkpoint_block_saved_bytes_16_bit_keep_float32_norms_and_softmax(dtype, attn, dropout):
    """Every branch of the formula at p = 2, each run (the property test above draws them): the
    norms' float32 inputs and 1/rms, and the float32 log-sum-exp ("sdpa"), softmax ("math"; its
    bf16 copy for P V without dropout) or whole core and q, k, v ("sdpa" with dropout, torch's
    CPU fallback). Counting them at 2 bytes, as the formula did, is 10-34 % short here."""
    cfg = GPTConfig(vocab_size=64, max_seq_len=24, n_layer=1, n_head=4, n_kv_head=2, d_model=16,
                    dropout=dropout, attn_impl=attn)
    model = GPT(cfg, dtype=dtype).train()
    x = torch.randn(3, 20, cfg.d_model, dtype=dtype, requires_grad=True)
    rows = saved_tensors(model.blocks[0], x, model.rope_cos[:20], model.rope_sin[:20], exclude_state_of=model)
    measured = sum({row.storage_key: row.storage_bytes for row in rows}.values())
    assert measured == block_saved_bytes(cfg, 3, 20, dtype)
    assert any(row.dtype == torch.float32 for row in rows)  # p = 2 alone would not be the count
    assert measured > block_saved_bytes(cfg, 3, 20, torch.float32) // 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("policy", "options"), [
    ("full", {}), ("full", {"use_reentrant": True}), ("every_k", {"every_k": 2}), ("every_k", {"every_k": 3}),
    ("selective", {}), ("selective", {"use_reentrant": True}), ("offload", {}),
])
@pytest.mark.parametrize("attn", ["math", "sdpa"])
def test_activation_checkpoint_model_saved_bytes_drop_as_formula_predicts(dtype, policy, options, attn):
    """Whole GPT, 5 blocks, dropout on: plain minus policy equals the formula's drop, exactly."""
    cfg = GPTConfig.preset("tiny").with_(n_layer=5, dropout=0.1, attn_impl=attn)
    idx, targets = tokens(cfg, 3, 20)
    model = GPT(cfg, dtype=dtype)
    plain = saved_bytes(model, idx, targets)
    apply_policy(model, policy, **options)
    drop = plain - saved_bytes(model, idx, targets)
    assert drop == model_saved_bytes_drop(cfg, 3, 20, dtype, policy, options.get("every_k"))
    assert drop > 0


def test_activation_checkpoint_full_keeps_one_input_per_block():
    """`full`: a block keeps p*sbh bytes, its input: the 2sbh (16-bit) of Korthikanti et al."""
    cfg = GPTConfig.preset("tiny").with_(dropout=0.1)
    assert block_saved_bytes(cfg, 2, 16, torch.float32, "full") == 4 * 2 * 16 * cfg.d_model
    # and what `full` saves is a small fraction of the plain block's bytes here:
    assert block_saved_bytes(cfg, 2, 16, torch.float32, "full") < block_saved_bytes(cfg, 2, 16, torch.float32) / 20


def test_activation_checkpoint_korthikanti_formula_values():
    # GPT-3 175B's layer at s=2048, b=1, h=12288, a=96 (their Table 2 setting): 34 + 5*96*2048/12288 = 114
    assert korthikanti_layer_bytes(2048, 1, 12288, 96) == 2048 * 12288 * 114


def test_activation_checkpoint_saved_bytes_dedupes_storage_and_skips_parameters():
    lin = torch.nn.Linear(6, 6, bias=False)
    x = torch.randn(4, 6, requires_grad=True)

    def fn(x):
        y = x.exp()  # saves y (its result)
        return lin(y.t().sin().t())  # sin saves y.t(): the same storage; lin saves its weight

    rows = saved_tensors(fn, x, exclude_state_of=lin)
    assert all(r.storage_key != (str(lin.weight.device), lin.weight.data_ptr()) for r in rows)
    # y (4x6), and the sin output transposed back, which Linear saves as its input (4x6)
    assert saved_bytes(fn, x, exclude_state_of=lin) == 2 * 4 * 6 * 4
    assert len(rows) >= 3  # y was saved twice (exp, sin) but counted once


def test_activation_checkpoint_peak_bytes_counts_live_storage():
    def step():
        a = torch.ones(1000)  # 4000 bytes
        b = a * 2  # 8000 live
        del a
        c = b + 1  # 8000 live again (a is gone)
        return c.sum()

    assert peak_bytes(step) == 8000 + 4  # + the 4-byte sum


def test_activation_checkpoint_full_policy_lowers_peak_memory():
    """The peak of a whole step (forward, recompute, backward), not just what is saved."""
    cfg = GPTConfig.preset("tiny").with_(n_layer=6, attn_impl="math")
    idx, targets = tokens(cfg, 4, 32)
    peaks = {}
    for policy in ("none", "full"):
        model = apply_policy(GPT(cfg), policy)
        peaks[policy] = peak_bytes(lambda: model(idx, targets).backward())  # noqa: B023
    assert peaks["full"] < 0.6 * peaks["none"]


def test_activation_checkpoint_around_a_single_linear_saves_nothing():
    """DT-8: checkpointing one Linear keeps its input as the checkpoint, which is all a
    Linear saves anyway: zero bytes saved, one matmul recomputed."""
    lin = torch.nn.Linear(16, 16, bias=False)
    x = torch.randn(8, 16, requires_grad=True)
    plain = saved_bytes(lin, x)
    for use_reentrant in (False, True):
        def checkpointed(x, use_reentrant=use_reentrant):
            return checkpoint(lin, x, use_reentrant=use_reentrant)

        ckpt = saved_bytes(checkpointed, x, exclude_state_of=lin)
        assert ckpt == plain == x.numel() * 4
