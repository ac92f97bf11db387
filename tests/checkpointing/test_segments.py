"""Chen et al.'s segments: same gradients, and the bytes kept are n/k inputs plus the last segment."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tinyscale.checkpointing import block_saved_bytes, checkpoint_in_segments, peak_bytes, saved_bytes
from tinyscale.models import GPT, GPTConfig


def gpt(n_layer, dtype=torch.float64):
    cfg = GPTConfig.preset("tiny").with_(n_layer=n_layer, dropout=0.1, attn_impl="math")
    return cfg, GPT(cfg, seed=0, dtype=dtype)


@given(n_layer=st.integers(1, 6), segment_size=st.integers(1, 7), seed=st.integers(0, 2**16),
       use_reentrant=st.booleans())
def test_activation_checkpoint_segments_grads_bit_identical_with_dropout(n_layer, segment_size, seed, use_reentrant):
    _, model = gpt(n_layer)
    cos, sin = model.rope_cos[:10], model.rope_sin[:10]
    x = torch.randn(2, 10, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    results = []
    for segments in (False, True):
        torch.manual_seed(seed)
        if segments:
            out = checkpoint_in_segments(model.blocks, x, cos, sin, segment_size=segment_size,
                                         use_reentrant=use_reentrant)
        else:
            out = x
            for block in model.blocks:
                out = block(out, cos, sin)
        out.pow(2).sum().backward()
        results.append([out.detach(), x.grad, *(p.grad.clone() for p in model.blocks.parameters())])
        x.grad = None
        model.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize(("n_layer", "segment_size"), [(6, 1), (6, 2), (6, 4), (6, 6), (5, 2)])
def test_activation_checkpoint_segments_keep_one_input_per_segment_plus_the_last(n_layer, segment_size):
    cfg, model = gpt(n_layer, torch.float32)
    B, T = 2, 12
    x = torch.randn(B, T, 32, requires_grad=True)
    measured = saved_bytes(checkpoint_in_segments, model.blocks, x, model.rope_cos[:T], model.rope_sin[:T],
                           segment_size=segment_size, exclude_state_of=model)
    segments = math.ceil(n_layer / segment_size)
    last = n_layer - (segments - 1) * segment_size  # blocks in the plain last segment
    per_input = block_saved_bytes(cfg, B, T, torch.float32, "full")
    assert measured == (segments - 1) * per_input + last * block_saved_bytes(cfg, B, T, torch.float32)


def test_activation_checkpoint_segments_sqrt_n_is_best_for_a_chain_of_small_layers():
    """n = 16 layers of tanh(Linear): each keeps about its input (A ~ I), so the peak over a
    step is smallest near k = sqrt(16) = 4, not at k = 1 or k = n (Chen et al.)."""
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(16)]
    x = torch.randn(512, 16, requires_grad=True)

    def peak(k):
        return peak_bytes(lambda: checkpoint_in_segments(layers, x, segment_size=k).sum().backward())

    peaks = {k: peak(k) for k in (1, 2, 4, 8, 16)}
    assert min(peaks, key=peaks.get) in (2, 4, 8)
    assert peaks[4] < peaks[1] and peaks[4] < peaks[16]


def test_activation_checkpoint_segments_bad_size_raises():
    with pytest.raises(ValueError, match="segment_size=0"):
        checkpoint_in_segments([torch.nn.Identity()], torch.ones(1), segment_size=0)
