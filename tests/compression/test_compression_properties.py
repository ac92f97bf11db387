"""Compressors in one process: what each keeps, unbiasedness, exact error feedback, packing.

Run: `pytest -k compression`. Multi-rank behaviour (ledger bytes, hooks, agreement with
torch's PowerSGD hook, 1-bit Adam): test_compression_ranks.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

from tinyscale.compression import QSGD, BlockInt8, ErrorFeedback, RandomK, TopK, pack_nibbles, unpack_nibbles
from tinyscale.compression.onebit import one_bit, pack_signs, unpack_signs
from tinyscale.compression.powersgd import orthogonalise


def _vec(n: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@given(n=st.integers(1, 300), ratio=st.floats(0.01, 1.0), seed=st.integers(0, 2**16))
def test_compression_topk_keeps_the_k_largest_magnitudes_with_their_signs(n, ratio, seed):
    x = _vec(n, seed)
    comp = TopK(ratio)
    payload = comp.compress(x)
    k = min(n, max(1, math.ceil(ratio * n)))
    out = comp.decompress(payload)
    kept = out != 0
    assert int(kept.sum()) == k  # randn has no exact zeros (probability 0)
    assert torch.equal(out[kept], x[kept])  # values and signs untouched
    if k < n:  # everything kept is at least as large as everything dropped
        assert x[kept].abs().min() >= x[~kept].abs().max()
    assert payload.nbytes == comp.wire_bytes(n, x.dtype) == k * (8 + 4)  # float64 values, int32 indices


def test_compression_randomk_draws_the_same_indices_from_the_same_seed_and_new_ones_each_call():
    a, b = RandomK(0.25, seed=7), RandomK(0.25, seed=7)
    first = a.indices(40)
    assert torch.equal(first, b.indices(40)) and first.numel() == 10
    assert not torch.equal(a.indices(40), first)  # the next call draws afresh
    x = _vec(40, 1)
    out = RandomK(0.25, seed=7).decompress(RandomK(0.25, seed=7).compress(x))
    assert torch.equal(out[first], x[first]) and int((out != 0).sum()) == 10


@pytest.mark.parametrize("bits", [8, 4])
def test_compression_qsgd_is_unbiased_within_the_bound_its_variance_gives(bits):
    x = _vec(64, 3)
    comp, draws = QSGD(bits, seed=11), 4000
    levels = 2 ** (bits - 1) - 1
    total = torch.zeros_like(x)
    for _ in range(draws):
        total += comp.decompress(comp.compress(x))
    mean = total / draws
    # Each draw rounds |x| / scale * s up or down to a neighbouring level: the error of one
    # draw is at most scale / s and its variance at most (scale / s)^2 / 4. The mean of
    # `draws` independent draws has standard deviation <= scale / (2 s sqrt(draws)); 6 of those
    # bound all 64 elements with probability > 1 - 64 * 2e-9. A biased rounding (floor,
    # nearest) is off by up to scale / (2 s), ~30 of those deviations, and fails.
    sigma = x.abs().max() / (2 * levels * math.sqrt(draws))
    assert (mean - x).abs().max() <= 6 * sigma
    nearest = (x.abs() / x.abs().max() * levels).round() * x.abs().max() / levels  # a deterministic rounding
    assert (nearest - x.abs()).abs().max() > 6 * sigma  # the bound has teeth: it would fail


@given(n=st.integers(1, 200), bits=st.sampled_from([8, 4]), seed=st.integers(0, 2**16))
def test_compression_qsgd_codes_stay_in_range_and_pack_to_the_stated_bytes(n, bits, seed):
    x = _vec(n, seed) * 10
    comp = QSGD(bits, seed=seed)
    payload = comp.compress(x)
    assert payload.nbytes == comp.wire_bytes(n, x.dtype) == (n if bits == 8 else (n + 1) // 2)
    out = comp.decompress(payload)
    step = x.abs().max() / (2 ** (bits - 1) - 1)
    assert ((out - x).abs() <= step * (1 + 1e-12)).all()  # within one level (1e-12: float64 rounding of the division)
    assert (torch.sign(out) * torch.sign(x) >= 0).all()  # never flips a sign


def test_compression_qsgd_of_zeros_is_zeros_not_nan():
    for bits in (8, 4):
        out = QSGD(bits).decompress(QSGD(bits).compress(torch.zeros(9, dtype=torch.float64)))
        assert torch.equal(out, torch.zeros(9, dtype=torch.float64))


@given(codes=st.lists(st.integers(-7, 7), min_size=1, max_size=65))
def test_compression_int4_packing_round_trips(codes):
    t = torch.tensor(codes, dtype=torch.int8)
    packed = pack_nibbles(t)
    assert packed.dtype == torch.uint8 and packed.numel() == (len(codes) + 1) // 2
    assert torch.equal(unpack_nibbles(packed, len(codes)), t)


@given(n=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_compression_one_bit_signs_round_trip_and_keep_the_l1_norm(n, seed):
    x = _vec(n, seed)
    signs, scale = one_bit(x)
    assert signs.numel() == math.ceil(n / 8)
    restored = unpack_signs(signs, n, x.dtype) * scale
    assert torch.equal(torch.sign(restored), torch.where(x >= 0, 1.0, -1.0).to(x.dtype))
    assert torch.allclose(restored.abs().sum(), x.abs().sum(), rtol=1e-12)  # float64 sum order only
    assert torch.equal(unpack_signs(pack_signs(x), n, x.dtype), torch.where(x >= 0, 1.0, -1.0).to(x.dtype))


@given(kind=st.sampled_from(["topk", "randomk"]), n=st.integers(1, 100), steps=st.integers(1, 6),
       ratio=st.floats(0.05, 1.0), seed=st.integers(0, 2**16))
def test_compression_feedback_conserves_mass_exactly(kind, n, steps, ratio, seed):
    # Integer-valued float64 gradients: every sum below is exact, so "sent + residual = sum of
    # gradients" can be checked with torch.equal (a lost or double-counted element breaks it).
    gen = torch.Generator().manual_seed(seed)
    feedback = ErrorFeedback(TopK(ratio) if kind == "topk" else RandomK(ratio, seed=seed))
    grads = [torch.randint(-50, 50, (n,), generator=gen).to(torch.float64) for _ in range(steps)]
    sent = torch.zeros(n, dtype=torch.float64)
    for g in grads:
        sent += feedback.compressor.decompress(feedback.compress("bucket", g))
    assert torch.equal(sent + feedback.residuals["bucket"], sum(grads))


def test_compression_feedback_conserves_mass_for_qsgd_to_rounding():
    feedback, total, sent = ErrorFeedback(QSGD(4, seed=1)), torch.zeros(50, dtype=torch.float64), 0
    for step in range(5):
        g = _vec(50, step)
        total += g
        sent = sent + feedback.compressor.decompress(feedback.compress(0, g))
    # float64: each step's acc - D(p) and the running sums round at ~1e-16 relative; 1e-12 allows that
    # for 5 steps while a residual that forgot one step's dropped part is off by O(0.1).
    assert torch.allclose(sent + feedback.residuals[0], total, rtol=0, atol=1e-12)


@given(n=st.integers(3, 20), m=st.integers(1, 6), r=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_compression_powersgd_orthogonalise_gives_orthonormal_columns(n, m, r, seed):
    r = min(r, n)
    mat = torch.randn(n, r, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    q = orthogonalise(mat.clone())
    # 1e-10: Gram-Schmidt on a random float64 n x r loses ~cond(mat) x 1e-16; these are well conditioned.
    assert torch.allclose(q.T @ q, torch.eye(r, dtype=torch.float64), atol=1e-10)
    assert torch.linalg.matrix_rank(torch.cat([q, mat], dim=1)) == r  # the same column space


@pytest.mark.parametrize("bad", [
    (lambda: TopK(0), "ratio=0"), (lambda: RandomK(1.5), "ratio=1.5"), (lambda: QSGD(3), "bits=3"),
    (lambda: TopK(0.5).compress(torch.zeros(2, 2)), "flat"),
])
def test_compression_bad_arguments_name_the_field(bad):
    make, words = bad
    with pytest.raises(ValueError, match=words):
        make()


def test_compression_block_int8_rounds_each_block_to_half_a_step_of_its_own_scale():
    x = _vec(40, 5)
    x[3] = 1000.0  # an outlier in block 0 only: the other blocks keep their resolution
    comp = BlockInt8(16)
    out = comp.decompress(comp.compress(x))
    for b in range(3):
        block = slice(16 * b, 16 * b + 16)
        step = x[block].abs().max() / 127
        assert ((out[block] - x[block]).abs() <= step / 2 * (1 + 1e-6)).all()  # 1e-6: float32 scale arithmetic
    assert (out[16:] != 0).all()  # QSGD's one scale would zero most of these
    assert comp.wire_bytes(40, torch.float64) == 40 + 3 * 8
