"""The compressor interface, and the one collective every compressor uses.

A compressor turns a rank's flat gradient into a *payload* (the tensors that go on the
wire) and back. Two kinds of payload need two different collectives:

- **aligned** payloads mean the same thing position by position on every rank (random-k
  with a shared seed picks the same indices everywhere), so they can be summed as they
  travel: one all-reduce of the payload;
- **unaligned** payloads do not (top-k picks different indices on every rank; quantized
  codes cannot be added without overflowing their few bits), so every rank all-gathers
  every payload, decompresses each and sums. The bytes then grow with the world size,
  which is the price the lesson's table shows.

`compressed_mean(x, compressor, group)` runs either path and returns the mean over the
group of every rank's decompressed payload. `Compressor.wire_bytes` is the payload's size
for one rank; the ledger's bytes must equal `ledger_bytes` (tests: `pytest -k compression`).

Shape legend: n elements of the flat gradient, k kept elements, N ranks in the group.
Lesson: lessons/10-compression.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tinyscale.dist import comm


@dataclass
class Payload:
    """What one rank sends: named tensors, plus what decompression needs to rebuild (n, dtype)."""

    tensors: dict[str, torch.Tensor]
    numel: int
    dtype: torch.dtype
    meta: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class Compressor:
    """Base class. `aligned`: payloads of different ranks can be summed element by element."""

    aligned = False

    def agree(self, x: torch.Tensor, group=None) -> None:
        """Settle what every rank must share before compressing (a quantization scale); no-op here."""

    def compress(self, x: torch.Tensor) -> Payload:  # x: (n,)
        raise NotImplementedError

    def decompress(self, payload: Payload) -> torch.Tensor:  # -> (n,)
        raise NotImplementedError

    def wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        """Bytes of one rank's payload for a flat gradient of `numel` elements of `dtype`."""
        raise NotImplementedError

    def agree_bytes(self, numel: int, dtype: torch.dtype) -> int:
        """Bytes all-reduced by `agree` (0 unless the compressor agrees on something)."""
        return 0

    def state_dict(self) -> dict:
        """What compressing changes (a random stream's position): a dropped step or a resume restores it."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Set what `state_dict` returned."""

    def ledger_bytes(self, numel: int, dtype: torch.dtype, world: int) -> int:
        """What the ledger records for one `compressed_mean` (its 'size' convention, see
        tinyscale.dist.comm): an all-reduce counts the payload once, an all-gather N times."""
        payload = self.wire_bytes(numel, dtype)
        return self.agree_bytes(numel, dtype) + (payload if self.aligned else world * payload)


def split_like(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat`, consecutive, shaped like each tensor of `like` (the inverse of a cat of them)."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def completed(value: torch.Tensor) -> torch.futures.Future:
    """A future that already holds `value` (what a comm hook that communicated synchronously returns)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def _check_flat(x: torch.Tensor, who: str) -> None:
    if x.dim() != 1:
        raise ValueError(f"{who}: expected a flat (1-D) gradient, got shape {tuple(x.shape)}; pass x.view(-1)")


# --8<-- [start:compressed_mean]
def compressed_mean(x: torch.Tensor, compressor: Compressor, group=None,
                    payload: Payload | None = None) -> torch.Tensor:
    """The mean over `group` of every rank's decompressed payload of `x` (n,). Pass `payload`
    when the caller compressed already (error feedback needs the payload to update its residual)."""
    _check_flat(x, "compressed_mean")
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if payload is None:
        compressor.agree(x, group)
        payload = compressor.compress(x)
    if world == 1:
        return compressor.decompress(payload)
    if compressor.aligned:  # same meaning at every position on every rank: sum on the wire
        for t in payload.tensors.values():
            comm.all_reduce(t, group=group)
        return compressor.decompress(payload).div_(world)
    gathered = {name: torch.empty(world * t.numel(), dtype=t.dtype, device=t.device)
                for name, t in payload.tensors.items()}
    for name, t in payload.tensors.items():
        comm.all_gather(gathered[name], t.contiguous(), group=group)
    total = torch.zeros(payload.numel, dtype=payload.dtype, device=x.device)
    for r in range(world):  # decompress every rank's payload and add, in rank order on every rank
        theirs = {name: g.view(world, -1)[r] for name, g in gathered.items()}
        total += compressor.decompress(Payload(theirs, payload.numel, payload.dtype, payload.meta))
    return total.div_(world)
# --8<-- [end:compressed_mean]
