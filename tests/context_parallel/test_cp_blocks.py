"""The block kernel ring attention and Ulysses run (blocks.py) keeps merge.py's contract.

The CPU flash kernel's (out, lse) and gradients equal merge.py's float64 reference, with GQA,
padded keys in full and causal blocks, rows that see no key (lse -inf, gradient 0) and a
block of only padded keys; float64 CPU tensors take the kernel. Run: `pytest -k cp_blocks`.
"""

from __future__ import annotations

import pytest
import torch

from tinyscale.context_parallel import blocks
from tinyscale.context_parallel.merge import block_attention, block_attention_backward

# float64: the kernel and the reference differ only in summation order and the kernel's
# blocked online softmax, a few ulps (~1e-15 seen); 1e-12 leaves 1000x, a wrong mask or a
# wrong GQA grouping is off by 1e-2 or more.
TOL = 1e-12


def _qkv(B=2, H=4, K=2, Tq=6, Tk=6, D=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, Tq, D, generator=g, dtype=dtype), torch.randn(B, K, Tk, D, generator=g, dtype=dtype),
            torch.randn(B, K, Tk, D, generator=g, dtype=dtype))


def test_cp_blocks_float64_on_the_cpu_takes_the_flash_kernel(monkeypatch):
    q, k, v = _qkv()
    assert blocks.cpu_flash_ok(q)
    monkeypatch.setattr(blocks, "block_attention", None)  # the reference would raise TypeError
    blocks.attend(q, k, v, causal_mask_kind="causal", scale=0.3)


@pytest.mark.parametrize("kind", ["full", "causal"])
@pytest.mark.parametrize("valid", [None, [1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]],
                         ids=["all", "tail-padded", "head-padded", "none"])
def test_cp_blocks_kernel_equals_the_float64_reference(kind, valid):
    """Forward (out, lse) and backward (given the rows' out and lse) as merge.py computes them."""
    q, k, v = _qkv()
    key_valid = None if valid is None else torch.tensor(valid, dtype=torch.bool)
    kw = dict(causal_mask_kind=kind, scale=0.4, key_valid=key_valid)
    out, lse = blocks.attend(q, k, v, **kw)
    want_out, want_lse = block_attention(q, k, v, **kw)
    torch.testing.assert_close(out, want_out, rtol=TOL, atol=TOL)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))  # blind rows: -inf, as the merge needs
    torch.testing.assert_close(lse, want_lse, rtol=TOL, atol=TOL)
    dout = torch.randn_like(out)
    got = blocks.attend_backward(dout, q, k, v, out, lse, **kw)
    want = block_attention_backward(dout, q, k, v, want_out, want_lse, **kw)
    for name, a, b in zip("qkv", got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL, msg=lambda m, n=name: f"d{n}: {m}")


def test_cp_blocks_autograd_function_matches_autograd_through_the_reference():
    """BlockAttention (Ulysses' block): its gradient is autograd's through merge.py's block."""
    q, k, v = (t.requires_grad_() for t in _qkv(H=6, K=3, Tq=7, Tk=7))
    out, _ = blocks.BlockAttention.apply(q, k, v, "causal", 0.5, None)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref, _ = block_attention(q, k, v, causal_mask_kind="causal", scale=0.5)
    want = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


# bf16: the kernel computes in float32 and rounds its output to bf16 (8 bits, ~4e-3 relative);
# 2e-2 is 5x that, and a wrong mask is off by O(1).
def test_cp_blocks_bfloat16_close_to_float64():
    q, k, v = _qkv(Tq=16, Tk=16, D=16)
    out, lse = blocks.attend(*(t.bfloat16() for t in (q, k, v)), causal_mask_kind="causal", scale=0.25)
    want_out, want_lse = block_attention(q, k, v, causal_mask_kind="causal", scale=0.25)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.double(), want_lse, rtol=2e-2, atol=2e-2)
