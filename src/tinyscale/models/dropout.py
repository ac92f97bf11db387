"""Counter-based dropout: each keep-mask a pure function of where its element sits.

    GPTConfig(dropout=0.1, dropout_masks="counter")
    set_dropout_clock(model, step=step, row0=first_row)   # the trainer, before each micro-batch

A dropout site's keep-mask is not drawn from a generator's stream but hashed from the
element's global coordinates: (seed, step, layer, site) and then the row's index in the
GLOBAL batch, the head, the query and key positions (attention probabilities) or the token
position and feature (the residual branches). u = hash / 2^53 is uniform in [0, 1); the
element is kept if u >= p and scaled by 1 / (1 - p), as `F.dropout` does. Because nothing
depends on which process computes the element, one process and any tensor, sequence,
context, pipeline or data-parallel split, any micro-batching and any recomputation draw the
same masks, with no generator state to share, carry, restore or checkpoint. The same idea as
Philox (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): a random
number is a keyed function of a counter. Here the counter is the coordinates.

The hash: splitmix64's finaliser (Steele, Lea, Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014), chained over the coordinates, h <- mix(h + (c + 1) * gamma), in
torch int64 arithmetic (multiplication wraps modulo 2^64 on every device; right shifts are
made logical by masking). The coordinates broadcast outer to inner (rows, then heads, then
positions), so all but the last mix run on small tensors: one mix per element.

Who sets what: `DropoutClock` (one per GPT, shared by its blocks) holds the seed
(`GPTConfig.dropout_seed`), the step, the global row of the micro-batch's first row and, under
context parallelism, the global positions of the local tokens. `tinyscale.reference.train` and the engine set the step and
row before every micro-batch's passes (a pipeline before each forward and backward), so a
recomputation in backward reads the same clock. Sites: the attention probabilities
(`SITE_PROBS`), the attention and MLP residual branches (`SITE_ATTN`, `SITE_MLP`).
Lesson: lessons/07-tensor-parallel.md ("Dropout that does not depend on the layout").
Tests: `pytest tests/models/test_counter_dropout.py tests/engine/test_layout_dropout.py`.
"""

from __future__ import annotations

import dataclasses
import math

import torch

MASK_MODES = ("stream", "counter")
SITE_PROBS, SITE_ATTN, SITE_MLP = 0, 1, 2

_U64 = 1 << 64


def _signed(value: int) -> int:
    """A value modulo 2^64 as the int64 with the same bits."""
    value %= _U64
    return value - _U64 if value >= 1 << 63 else value


GAMMA = _signed(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: splitmix64's increment
M1, M2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
BITS = 53  # uniform draws have 53 bits, like a float64 in [0, 1)


# --8<-- [start:mix]
def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic: it copies the sign bit)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors, in place: every output bit depends on every
    input bit. (In place: on the CPU a fresh 8-byte-per-element tensor per step costs more
    than the arithmetic.)"""
    z ^= _shr(z, 30)
    z *= M1  # wraps modulo 2^64
    z ^= _shr(z, 27)
    z *= M2
    z ^= _shr(z, 31)
    return z


def mix64(z: torch.Tensor) -> torch.Tensor:
    return _mix64_(z.clone())


def hash_coordinates(key: int | torch.Tensor, *coords: torch.Tensor) -> torch.Tensor:
    """mix(... mix(mix(key + (c0 + 1) gamma) + (c1 + 1) gamma) ...): int64 coordinates broadcast
    together (give them outer to inner, so the early mixes run on the small tensors)."""
    h = key
    for c in coords:
        h = _mix64_(h + (c + 1) * GAMMA)  # the sum is a new tensor: mixing it in place is safe
    return h


def keep_mask(p: float, key: int, *coords: torch.Tensor) -> torch.Tensor:
    """True where the element at `coords` is kept: u = (top 53 bits) / 2^53 >= p."""
    threshold = math.ceil(p * 2**BITS)  # u >= p  <=>  bits >= p 2^53 (exact: a power-of-two scale)
    return _shr(hash_coordinates(key, *coords), 64 - BITS) >= threshold
# --8<-- [end:mix]


def site_key(seed: int, step: int, layer: int, site: int) -> int:
    """One int64 key per (seed, step, layer, site): the outer coordinates, hashed once on the CPU."""
    coords = [torch.tensor(v, dtype=torch.int64) for v in (step, layer, site)]
    return int(hash_coordinates(torch.tensor(_signed(seed), dtype=torch.int64), *coords))


def _arange(n: int, device, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64, device=device)


@dataclasses.dataclass
class DropoutClock:
    """Where the micro-batch now running sits: shared by a GPT and its blocks, set by the trainer.

    positions: the global position of each token of the model's local sequence ((T,) int64;
    None: 0..T-1), set by context parallelism's forward."""

    seed: int = 0
    step: int = 0
    row0: int = 0
    positions: torch.Tensor | None = None

    def rows(self, n: int, device) -> torch.Tensor:
        """(n,) global row index of each row of the micro-batch."""
        return _arange(n, device, self.row0)

    def token_positions(self, n: int, device, sequence_shard: tuple[int, int] | None = None) -> torch.Tensor:
        """(n,) global positions of a sequence of n local tokens; sequence_shard (rank, ranks):
        n is that rank's contiguous slice of the sequence (sequence parallelism)."""
        ranks = 1 if sequence_shard is None else sequence_shard[1]
        full = _arange(n * ranks, device) if self.positions is None else self.positions.to(device)
        return full if sequence_shard is None else full.chunk(ranks)[sequence_shard[0]]


def set_dropout_clock(model: torch.nn.Module, *, step: int, row0: int) -> None:
    """Tell `model` (a GPT; anything else is left alone) which step and global rows come next."""
    clock = getattr(model, "dropout_clock", None)
    if isinstance(clock, DropoutClock):
        clock.step, clock.row0 = step, row0


# --8<-- [start:sites]
def residual_dropout(h: torch.Tensor, p: float, clock: DropoutClock, layer: int, site: int,
                     sequence_shard: tuple[int, int] | None = None) -> torch.Tensor:
    """Counter dropout of a residual branch h (B, T, C); T may be a sequence-parallel slice."""
    B, T, C = h.shape
    rows = clock.rows(B, h.device)[:, None, None]  # (B, 1, 1)
    positions = clock.token_positions(T, h.device, sequence_shard)[None, :, None]  # (1, T, 1)
    features = _arange(C, h.device)[None, None, :]  # (1, 1, C): the residual stream is never split on C
    keep = keep_mask(p, site_key(clock.seed, clock.step, layer, site), rows, positions, features)
    return h * (keep.to(h.dtype) * (1.0 / (1.0 - p)))  # (B, T, C)


@dataclasses.dataclass(frozen=True)
class ProbsDropout:
    """One layer call's attention-probability dropout: its key, global rows and global heads.
    Snapshot at the forward, so a ring's backward or a recomputation redraws the same mask."""

    p: float
    key: int
    rows: torch.Tensor  # (B,) global row indices
    heads: torch.Tensor  # (H,) global head index of each local head

    @classmethod
    def at(cls, p: float, clock: DropoutClock, layer: int, rows: int, heads: int, head0: int,
           device) -> ProbsDropout:
        return cls(p, site_key(clock.seed, clock.step, layer, SITE_PROBS), clock.rows(rows, device),
                   _arange(heads, device, head0))

    def with_heads(self, heads: torch.Tensor) -> ProbsDropout:
        return dataclasses.replace(self, heads=heads)

    def scale(self, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B, H, Tq, Tk): 0 where dropped, 1 / (1 - p) where kept, for queries at global
        positions q_pos (Tq,) and keys at k_pos (Tk,)."""
        q_pos, k_pos = q_pos.to(self.rows.device), k_pos.to(self.rows.device)
        keep = keep_mask(self.p, self.key, self.rows[:, None, None, None], self.heads[None, :, None, None],
                         q_pos[None, None, :, None], k_pos[None, None, None, :])  # (B, H, Tq, Tk)
        return keep.to(dtype) * (1.0 / (1.0 - self.p))
# --8<-- [end:sites]
