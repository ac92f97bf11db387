"""TinyMLP: the smallest model with the parameter-sharing cases that break naive parallel code.

The distributed harness tests (data parallelism, ZeRO, precision, checkpointing) train this
model because it is fast in float64 and has every awkward kind of parameter:

- `shared` is applied twice in one forward: its gradient is the sum of two contributions,
  so gradient hooks fire once per use and a "grad is ready" counter must not fire early;
- `frozen` has requires_grad=False: it gets no gradient, and must be neither reduced,
  sharded into optimizer state, nor updated (but must still be saved and loaded);
- the output projection reuses `fc_in.weight` transposed, a tied weight like an LM head tied
  to its embedding: named_parameters() lists it once, its gradient has two contributions.

Shape legend: N rows, I input/output width (dim), Hd hidden width.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class TinyMLP(nn.Module):
    """x (N, I) -> tanh(fc_in) -> tanh(shared) -> tanh(frozen) -> tanh(shared) -> fc_in^T -> (N, I)."""

    def __init__(self, dim: int = 8, hidden: int = 16, *, seed: int = 0, dtype: torch.dtype = torch.float64,
                 device=None) -> None:
        super().__init__()
        for field, value in (("dim", dim), ("hidden", hidden)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"TinyMLP {field}={value!r} is invalid: it must be a positive int")
        kw = dict(device=device, dtype=dtype)
        self.fc_in = nn.Linear(dim, hidden, **kw)
        self.shared = nn.Linear(hidden, hidden, **kw)
        self.frozen = nn.Linear(hidden, hidden, **kw)
        self.frozen.requires_grad_(False)
        self.out_bias = nn.Parameter(torch.empty(dim, **kw))
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Deterministic init from a CPU generator in named_parameters() order, device independent.

        Weights ~ N(0, 1/fan_in) keep tanh out of saturation; biases ~ N(0, 0.1) are nonzero so
        that a bias gradient that goes missing (or a frozen bias that moves) shows in a test.
        """
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for param in self.parameters():  # same order as named_parameters()
            std = 1.0 / math.sqrt(param.shape[1]) if param.dim() == 2 else 0.1
            param.copy_(torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean squared error over all elements (= mean over rows of per-row means)."""
        h = torch.tanh(self.fc_in(x))  # (N, Hd)
        h = torch.tanh(self.shared(h))  # (N, Hd): first use of `shared`
        h = torch.tanh(self.frozen(h))  # (N, Hd)
        h = torch.tanh(self.shared(h))  # (N, Hd): second use, same weights
        out = h @ self.fc_in.weight + self.out_bias  # (N, Hd) @ (Hd, I) -> (N, I): the tied weight
        return torch.mean((out - y) ** 2)
