"""tinyscale.data: the stdlib corpus, batch sampling, synthetic data and the batch-split rule."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tinyscale.data import (
    VOCAB_SIZE,
    check_token_ids,
    corpus_info,
    local_micro_batches,
    micro_batches,
    sample_batches,
    shard_rows,
    stdlib_corpus,
    synthetic_regression_batches,
    synthetic_token_batches,
)

# ---------------------------------------------------------------- corpus


def test_data_corpus_is_nonempty_bytes_sorted_by_path():
    for split in ("train", "val"):
        corpus = stdlib_corpus(split)
        assert corpus.split == split and len(corpus.files) > 0
        assert corpus.tokens.dtype == torch.uint8 and corpus.tokens.dim() == 1 and len(corpus) > 10_000
        assert list(corpus.files) == sorted(corpus.files)
    assert VOCAB_SIZE == 256


def test_data_corpus_split_is_by_file_disjoint_and_about_five_percent():
    train, val = stdlib_corpus("train"), stdlib_corpus("val")
    assert not set(train.files) & set(val.files)
    for path in train.files + val.files:
        assert (zlib.crc32(path.encode()) % 100 < 5) == (path in val.files)  # the documented rule
    fraction = len(val.files) / (len(train.files) + len(val.files))
    assert 0.02 < fraction < 0.12, fraction  # 59 / 776 = 7.6% on CPython 3.11.7


def test_data_corpus_excludes_tests_and_third_party_code():
    for path in stdlib_corpus("train").files + stdlib_corpus("val").files:
        parts = Path(path).parts
        assert parts[0] != "test" and not {"site-packages", "dist-packages", "tests", "idlelib"} & set(parts)
        assert path.endswith(".py")


def test_data_corpus_tokens_are_the_files_joined_by_nul():
    corpus = stdlib_corpus("val")
    root = Path(corpus.root)
    expected = b"\x00".join((root / f).read_bytes() for f in corpus.files)
    assert bytes(corpus.tokens.numpy()) == expected
    assert int((corpus.tokens == 0).sum()) == len(corpus.files) - 1  # sources hold no NUL byte


def test_data_corpus_is_cached_and_info_adds_up():
    assert stdlib_corpus("train") is stdlib_corpus(split="train") is stdlib_corpus()
    info = corpus_info()
    assert info["val"] == {"files": len(stdlib_corpus("val").files), "bytes": len(stdlib_corpus("val"))}
    assert info["train"]["bytes"] > 5 * info["val"]["bytes"]  # train is the bulk
    assert Path(info["root"]).is_dir() and info["python"].count(".") == 2


def test_data_corpus_bad_split_raises():
    with pytest.raises(ValueError, match="split='test'.*'train' or 'val'"):
        stdlib_corpus("test")


# ---------------------------------------------------------------- sampling


def test_data_sample_batches_are_deterministic_windows_with_shifted_targets():
    tokens = stdlib_corpus("val").tokens
    a = sample_batches(tokens, num_batches=3, batch_size=4, seq_len=16, seed=0)
    b = sample_batches(tokens, num_batches=3, batch_size=4, seq_len=16, seed=0)
    c = sample_batches(tokens, num_batches=3, batch_size=4, seq_len=16, seed=1)
    assert len(a) == 3
    for (xa, ya), (xb, yb), (xc, _) in zip(a, b, c):
        assert xa.shape == ya.shape == (4, 16) and xa.dtype == ya.dtype == torch.int64
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and not torch.equal(xa, xc)
        assert torch.equal(xa[:, 1:], ya[:, :-1])


@given(seq_len=st.integers(1, 30), seed=st.integers(0, 10_000))
def test_data_sample_batches_rows_are_consecutive_corpus_windows(seq_len, seed):
    tokens = torch.arange(40, dtype=torch.uint8)  # token == its offset, so windows are visible
    for x, y in sample_batches(tokens, num_batches=2, batch_size=3, seq_len=seq_len, seed=seed):
        start = x[:, :1]  # (B, 1)
        assert torch.equal(x, start + torch.arange(seq_len)) and torch.equal(y, x + 1)
        assert int(y.max()) <= 39


def test_data_sample_batches_rejects_a_too_short_corpus():
    with pytest.raises(ValueError, match="10 tokens, fewer than seq_len \\+ 1 = 11"):
        sample_batches(torch.zeros(10, dtype=torch.uint8), num_batches=1, batch_size=1, seq_len=10, seed=0)
    sample_batches(torch.zeros(11, dtype=torch.uint8), num_batches=1, batch_size=1, seq_len=10, seed=0)
    with pytest.raises(ValueError, match="batch_size=0"):
        sample_batches(torch.zeros(11, dtype=torch.uint8), num_batches=1, batch_size=0, seq_len=4, seed=0)


# ---------------------------------------------------------------- synthetic data


def test_data_synthetic_tokens_are_deterministic_in_range_and_shifted():
    kwargs = dict(num_batches=2, batch_size=4, seq_len=24, vocab_size=50)
    a, b = synthetic_token_batches(**kwargs, seed=0), synthetic_token_batches(**kwargs, seed=0)
    c = synthetic_token_batches(**kwargs, seed=1)
    for (xa, ya), (xb, yb), (xc, _) in zip(a, b, c):
        assert xa.shape == (4, 24) and xa.dtype == torch.int64
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and not torch.equal(xa, xc)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
        check_token_ids(xa, 50)


def test_data_synthetic_tokens_are_learnable():
    # Without noise the next token is a function of the current one; with noise, mostly.
    def agreement(noise: float) -> float:
        batches = synthetic_token_batches(num_batches=4, batch_size=8, seq_len=32, seed=3, noise=noise)
        x = torch.cat([xb for xb, _ in batches]).flatten()
        y = torch.cat([yb for _, yb in batches]).flatten()
        # the best guess of the next token from the current one alone: its most frequent successor
        hits = sum(int((y[x == t] == torch.mode(y[x == t]).values).sum()) for t in x.unique())
        return hits / x.numel()

    assert agreement(0.0) == 1.0
    assert agreement(0.1) > 0.75


def test_data_synthetic_regression_is_a_noisy_linear_map():
    batches = synthetic_regression_batches(num_batches=3, batch_size=64, dim=5, seed=0)
    x = torch.cat([xb for xb, _ in batches])
    y = torch.cat([yb for _, yb in batches])
    assert x.shape == y.shape == (192, 5) and x.dtype == torch.float64
    fit = torch.linalg.lstsq(x, y).solution  # (5, 5)
    assert (x @ fit - y).pow(2).mean().sqrt() < 0.02  # noise std 0.01
    single = synthetic_regression_batches(num_batches=3, batch_size=64, dim=5, seed=0, dtype=torch.float32)
    assert single[0][0].dtype == torch.float32 and torch.equal(single[0][0], batches[0][0].float())
    assert not torch.equal(synthetic_regression_batches(num_batches=1, batch_size=4, dim=5, seed=1)[0][0],
                           batches[0][0][:4])


def test_data_check_token_ids_names_the_first_bad_id_and_where():
    ids = torch.tensor([[1, 2, 3], [4, 300, -2]])
    with pytest.raises(ValueError, match=r"inputs contains id 300 at position \(1, 1\); valid ids are 0\.\.255"):
        check_token_ids(ids, 256, name="inputs")
    with pytest.raises(ValueError, match="integer"):
        check_token_ids(ids.float(), 256)
    check_token_ids(ids.clamp(0, 255), 256)


# ---------------------------------------------------------------- the batch-split rule


def global_batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(rows * 3).view(rows, 3), torch.arange(rows) * 10  # row i holds i in both


@given(dp_size=st.integers(1, 4), micro_batch_size=st.integers(1, 4), accumulation_steps=st.integers(1, 3))
def test_data_split_rule_reassembles_the_global_batch(dp_size, micro_batch_size, accumulation_steps):
    rows = dp_size * micro_batch_size * accumulation_steps
    batch = global_batch(rows)
    pieces = []
    for dp_rank in range(dp_size):
        local = local_micro_batches(batch, dp_rank=dp_rank, dp_size=dp_size, micro_batch_size=micro_batch_size)
        assert len(local) == accumulation_steps
        for micro in local:
            assert all(t.shape[0] == micro_batch_size for t in micro)
            assert torch.equal(micro[1], micro[0][:, 0] // 3 * 10)  # rows stay paired across tensors
            for part, whole in zip(micro, batch):  # views into the global batch, no copies
                assert part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
            pieces.append(micro)
    for i, whole in enumerate(batch):  # concatenated in (rank, micro-batch) order: the global batch
        assert torch.equal(torch.cat([p[i] for p in pieces]), whole)


def test_data_shard_rows_gives_rank_r_the_r_th_block():
    inputs, _ = global_batch(6)
    assert torch.equal(shard_rows((inputs,), 2, 3)[0], inputs[4:6])
    assert [m[0].tolist() for m in micro_batches((torch.arange(6),), 2)] == [[0, 1], [2, 3], [4, 5]]


@given(rows=st.integers(1, 30), dp_size=st.integers(2, 5))
def test_data_split_rule_rejects_rows_not_divisible_by_dp_size(rows, dp_size):
    if rows % dp_size == 0:
        shard_rows(global_batch(rows), 0, dp_size)
        return
    with pytest.raises(ValueError, match=rf"{rows} rows, not divisible by the data-parallel size {dp_size}"):
        local_micro_batches(global_batch(rows), dp_rank=0, dp_size=dp_size, micro_batch_size=1)


def test_data_split_errors_state_the_numbers_and_the_identity():
    batch = global_batch(12)
    with pytest.raises(ValueError, match=r"12 rows = 6 per rank over dp_size=2, not divisible by "
                                         r"micro_batch_size=4.*train_micro_batch_size_per_gpu x "
                                         r"gradient_accumulation_steps x data-parallel size"):
        local_micro_batches(batch, dp_rank=0, dp_size=2, micro_batch_size=4)
    with pytest.raises(ValueError, match="train_batch_size must equal"):
        shard_rows(batch, 0, 5)
    with pytest.raises(ValueError, match="rank=3 is out of range for world_size=3"):
        shard_rows(batch, 3, 3)
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        micro_batches(batch, 0)
    with pytest.raises(ValueError, match=r"different dim-0 sizes \[12, 11\]"):
        micro_batches((batch[0], batch[1][:11]), 1)
    with pytest.raises(ValueError, match="non-empty tuple"):
        micro_batches((), 1)
