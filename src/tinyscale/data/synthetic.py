"""Synthetic batches for tests: tiny, deterministic from a seed, and learnable, so loss can fall.

`synthetic_token_batches` feeds the GPT; `synthetic_regression_batches` feeds TinyMLP. Both
return a list of global batches, each a tuple whose dim 0 is the batch (the engine's format),
and both draw from a CPU torch.Generator(seed): same arguments, same tensors, on any machine.
`check_token_ids` is the validation data producers run on token ids.

Shape legend: B batch rows, T sequence length, P pattern period, I regression width (dim).
"""

from __future__ import annotations

import torch


def _require_positive(owner: str, **values: int) -> None:
    for field, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{owner} {field}={value!r} is invalid: it must be a positive int")


def check_token_ids(ids: torch.Tensor, vocab_size: int, *, name: str = "token ids") -> None:
    """Raise ValueError naming the first id outside [0, vocab_size), its position and the valid range."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {ids.dtype}: convert with .long()")
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} contains id {int(ids[where])} at position {where}; valid ids are "
                         f"0..{vocab_size - 1} (vocab_size={vocab_size}): fix the data or the vocab_size")


def synthetic_token_batches(*, num_batches: int, batch_size: int, seq_len: int, vocab_size: int = 256,
                            seed: int, period: int = 16, noise: float = 0.1,
                            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Next-token batches [(inputs, targets)], each (B, T) int64, from a noisy repeating pattern.

    One pattern of `period` distinct tokens is drawn from the seed; each row reads it cyclically
    from a random phase, and each token is replaced by a uniform random one with probability
    `noise`. The next token is thus mostly a function of the current one: a model can learn it
    (loss falls from ln(vocab_size) toward the noise floor) but never perfectly.
    """
    _require_positive("synthetic_token_batches", num_batches=num_batches, batch_size=batch_size,
                      seq_len=seq_len, vocab_size=vocab_size, period=period)
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"synthetic_token_batches noise={noise!r} is invalid: it must be in [0, 1]")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    period = min(period, vocab_size)  # the pattern's tokens are distinct
    pattern = torch.randperm(vocab_size, generator=gen)[:period]  # (P,)
    phase = torch.randint(0, period, (num_batches, batch_size, 1), generator=gen)
    positions = (phase + torch.arange(seq_len + 1)) % period  # (num_batches, B, T + 1)
    rows = pattern[positions]  # (num_batches, B, T + 1)
    random_tokens = torch.randint(0, vocab_size, rows.shape, generator=gen)
    replace = torch.rand(rows.shape, generator=gen) < noise
    rows = torch.where(replace, random_tokens, rows).long()  # (num_batches, B, T + 1)
    return [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]  # (B, T) each


def synthetic_regression_batches(*, num_batches: int, batch_size: int, dim: int, seed: int,
                                 dtype: torch.dtype = torch.float64, noise: float = 0.01,
                                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Regression batches [(x, y)], each (B, I): y = x @ W^T + noise for one W drawn from the seed.

    Matches TinyMLP(dim=...).forward(x, y), which maps I features to I outputs.
    """
    _require_positive("synthetic_regression_batches", num_batches=num_batches, batch_size=batch_size,
                      dim=dim)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # Drawn in float64 then cast, so float32 and float64 batches hold the same numbers (rounded).
    weight = torch.randn(dim, dim, generator=gen, dtype=torch.float64) / dim ** 0.5  # (I, I)
    x = torch.randn(num_batches, batch_size, dim, generator=gen, dtype=torch.float64)  # (num_batches, B, I)
    y = x @ weight.T + noise * torch.randn(x.shape, generator=gen, dtype=torch.float64)  # (num_batches, B, I)
    # copy=True: each batch owns its storage (pickling or saving one must not carry all of them)
    return [(xb.to(dtype, copy=True), yb.to(dtype, copy=True)) for xb, yb in zip(x, y)]
