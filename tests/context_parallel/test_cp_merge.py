"""Block attention with its log-sum-exp, and the merge of blocks (no processes).

Blocks merged in any split equal attention over all keys (float64, and SDPA); the merge
stays finite when one block's lse exceeds the other's by 100s; rows that see no key in a
block (lse = -inf) give no NaN, in the values or the gradients. Run: `pytest -k cp_merge`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tinyscale.context_parallel.merge import block_attention, block_attention_backward, merge_lse, merge_partials


# Tolerance 1e-12 below: float64 on shapes this small differs only in summation order (a few ulps,
# ~1e-15); a wrong mask, a merge without its weights or a dropped block is off by 1e-2 or more.
def _qkv(B=2, H=4, K=2, Tq=6, Tk=6, D=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, Tq, D, generator=g, dtype=dtype), torch.randn(B, K, Tk, D, generator=g, dtype=dtype),
            torch.randn(B, K, Tk, D, generator=g, dtype=dtype))


def _sdpa(q, k, v, mask):
    G = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=mask)


@pytest.mark.parametrize("kind", ["full", "causal"])
def test_cp_merge_block_attention_matches_sdpa_with_gqa(kind):
    q, k, v = _qkv()
    mask = torch.ones(6, 6, dtype=torch.bool).tril() if kind == "causal" else None
    out, lse = block_attention(q, k, v, causal_mask_kind=kind, scale=8 ** -0.5)
    torch.testing.assert_close(out, _sdpa(q, k, v, mask), rtol=1e-12, atol=1e-12)
    scores = q @ k.repeat_interleave(2, 1).transpose(-2, -1) * 8 ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("split", [1, 3, 5])
def test_cp_merge_of_two_key_blocks_equals_attention_over_all_keys(split):
    q, k, v = _qkv(Tk=7)
    out, lse = block_attention(q, k, v, causal_mask_kind="full", scale=0.3)
    a = block_attention(q, k[:, :, :split], v[:, :, :split], causal_mask_kind="full", scale=0.3)
    b = block_attention(q, k[:, :, split:], v[:, :, split:], causal_mask_kind="full", scale=0.3)
    merged_out, merged_lse = merge_partials(*a, *b)
    torch.testing.assert_close(merged_out, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged_lse, lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cp_merge_is_stable_when_one_lse_dominates_by_hundreds(dtype):
    """exp(1000) overflows even float64: a merge without the max subtraction returns inf/NaN."""
    lse_a = torch.tensor([1000.0, 150.0, -5.0, 0.0], dtype=dtype)
    lse_b = torch.tensor([850.0, 0.0, 300.0, 0.0], dtype=dtype)
    out_a, out_b = torch.ones(4, 3, dtype=dtype), torch.full((4, 3), 2.0, dtype=dtype)
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # the dominant block wins: its weight is 1 - exp(-gap), within rounding of 1
    torch.testing.assert_close(lse, torch.tensor([1000.0, 150.0, 300.0, 0.6931471805599453], dtype=dtype))
    torch.testing.assert_close(out[:, 0], torch.tensor([1.0, 1.0, 2.0, 1.5], dtype=dtype))


def test_cp_merge_rows_that_see_no_key_are_zero_and_not_nan():
    """A causal diagonal block's empty rows do not exist, but a padded key block's do: here
    key_valid hides every key from block a; rows see only block b, or nothing at all."""
    q, k, v = _qkv(Tq=4, Tk=3)
    nothing = torch.zeros(3, dtype=torch.bool)
    out_a, lse_a = block_attention(q, k, v, causal_mask_kind="full", scale=0.5, key_valid=nothing)
    assert torch.isneginf(lse_a).all() and (out_a == 0).all()
    out_b, lse_b = block_attention(q, k, v, causal_mask_kind="full", scale=0.5)
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, out_b, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse_b, rtol=0, atol=0)
    both_empty_out, both_empty_lse = merge_partials(out_a, lse_a, out_a, lse_a)
    assert (both_empty_out == 0).all() and torch.isneginf(both_empty_lse).all()
    assert torch.isneginf(merge_lse(lse_a, lse_a)).all()


def test_cp_merge_gradients_finite_on_empty_rows():
    q, k, v = (t.requires_grad_() for t in _qkv(Tq=3, Tk=3))
    nothing = torch.tensor([False, False, False])
    a = block_attention(q, k, v, causal_mask_kind="full", scale=0.5, key_valid=nothing)
    b = block_attention(q, k, v, causal_mask_kind="causal", scale=0.5)
    out, lse = merge_partials(*a, *b)
    (out.sum() + lse.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("kind", ["full", "causal"])
def test_cp_merge_block_backward_matches_autograd(kind):
    """The ring's hand-written block backward, given the merged lse, against autograd."""
    q, k, v = (t.requires_grad_() for t in _qkv(H=6, K=3, Tq=5, Tk=5))
    valid = torch.tensor([True, True, True, False, True])
    out, lse = block_attention(q, k, v, causal_mask_kind=kind, scale=0.4, key_valid=valid)
    dout = torch.randn_like(out)
    (out * dout).sum().backward()
    dq, dk, dv = block_attention_backward(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
                                          causal_mask_kind=kind, scale=0.4, key_valid=valid)
    for mine, theirs in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_cp_merge_rejects_unknown_mask_kind_and_ragged_causal_block():
    q, k, v = _qkv(Tq=3, Tk=4)
    with pytest.raises(ValueError, match="causal_mask_kind='tri'"):
        block_attention(q, k, v, causal_mask_kind="tri", scale=1.0)
    with pytest.raises(ValueError, match="3 and 4"):
        block_attention(q, k, v, causal_mask_kind="causal", scale=1.0)
