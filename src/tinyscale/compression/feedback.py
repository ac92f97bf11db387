"""Error feedback (Seide et al. 2014; Karimireddy et al. 2019, "EF-SGD"): what a compressor
drops this step is added to the next step's gradient, so nothing is lost, only delayed.

    acc = g + e            # this step's gradient plus what was not sent before
    p   = C(acc)           # send p
    e   = acc - D(p)       # keep the rest for next time

Summed over steps, sent + residual = sum of gradients: the telescoping sum is exact in
exact arithmetic, and bit-exact in floating point for sparsifiers (D(p) is acc or 0 at each
position; `pytest -k compression_feedback`). Residuals are per tensor (keyed by a name, a
DDP bucket's index), live on the rank that owns them, and are never communicated.

Lesson: lessons/10-compression.md ("why error feedback restores convergence").
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from tinyscale.compression.base import Compressor, Payload


class ErrorFeedback:
    """Residuals of `compressor` per key; `compress(key, g)` returns the payload to send."""

    def __init__(self, compressor: Compressor):
        self.compressor = compressor
        self.residuals: dict[Hashable, torch.Tensor] = {}

    # --8<-- [start:feedback]
    def compress_with(self, g: torch.Tensor, residual: torch.Tensor | None, group=None) -> tuple[Payload, torch.Tensor]:
        """(payload of g + residual, the new residual: what that payload does not carry)."""
        acc = g + residual if residual is not None else g.clone()  # (n,)
        self.compressor.agree(acc, group)
        payload = self.compressor.compress(acc)
        return payload, acc - self.compressor.decompress(payload)

    def compress(self, key: Hashable, g: torch.Tensor, group=None) -> Payload:
        payload, self.residuals[key] = self.compress_with(g, self.residuals.get(key), group)
        return payload
    # --8<-- [end:feedback]
