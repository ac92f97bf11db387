"""Sparsifiers: keep k of the n elements. Top-k keeps the largest magnitudes, random-k a
random subset drawn from a seed every rank shares.

Top-k (Aji & Heafield 2017; Lin et al. 2018, "Deep Gradient Compression") sends (value,
index) pairs: 2k numbers, not k, so its ratio is k(b_v + b_i) / (n b_v), about 2k/n for fp32
values with int32 indices. Each rank keeps different indices, so payloads cannot be summed
on the wire: they are all-gathered (N payloads arrive at every rank). Without error feedback
the dropped mass is lost for good; with it (feedback.py) it is sent later.

Random-k with a shared seed picks the same indices on every rank, so no index travels and
the values are summed by one all-reduce of k numbers: the cheapest payload, but it ignores
which elements matter. Both are biased as written here (nothing rescaled by n/k), which is
what error feedback expects.

Shape legend: n elements, k kept. Lesson: lessons/10-compression.md.
"""

from __future__ import annotations

import math

import torch

from tinyscale.compression.base import Compressor, Payload, _check_flat


def kept(numel: int, ratio: float) -> int:
    """k = ceil(ratio * n), at least 1 and at most n."""
    return min(numel, max(1, math.ceil(ratio * numel)))


def _check_ratio(ratio: float, who: str) -> None:
    if not 0 < ratio <= 1:
        raise ValueError(f"{who}: ratio={ratio} must be in (0, 1] (the fraction of elements kept)")


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


# --8<-- [start:topk]
class TopK(Compressor):
    """Keep the k = ceil(ratio * n) largest |x|, with their signs; send values and indices."""

    def __init__(self, ratio: float):
        _check_ratio(ratio, "TopK")
        self.ratio = ratio

    def compress(self, x: torch.Tensor) -> Payload:
        _check_flat(x, "TopK.compress")
        k = kept(x.numel(), self.ratio)
        idx = x.abs().topk(k, sorted=False).indices  # (k,) positions of the largest magnitudes
        return Payload({"values": x[idx], "indices": idx.to(_index_dtype(x.numel()))}, x.numel(), x.dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        out = torch.zeros(payload.numel, dtype=payload.dtype, device=payload.tensors["values"].device)
        out[payload.tensors["indices"].long()] = payload.tensors["values"]
        return out

    def wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        k = kept(numel, self.ratio)
        return k * (dtype.itemsize + _index_dtype(numel).itemsize)
# --8<-- [end:topk]


class RandomK(Compressor):
    """Keep k = ceil(ratio * n) elements at positions drawn from a seed all ranks share.

    The i-th `compress` call draws from seed + i, so every rank must compress the same
    sequence of tensors (DDP's buckets are issued in one order everywhere)."""

    aligned = True

    def __init__(self, ratio: float, seed: int = 0):
        _check_ratio(ratio, "RandomK")
        self.ratio, self.seed, self.calls = ratio, seed, 0

    def indices(self, numel: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed + self.calls)
        self.calls += 1
        return torch.randperm(numel, generator=gen)[: kept(numel, self.ratio)].sort().values  # (k,)

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = state["calls"]

    def compress(self, x: torch.Tensor) -> Payload:
        _check_flat(x, "RandomK.compress")
        idx = self.indices(x.numel()).to(x.device)
        return Payload({"values": x[idx]}, x.numel(), x.dtype, {"indices": idx})

    def decompress(self, payload: Payload) -> torch.Tensor:
        out = torch.zeros(payload.numel, dtype=payload.dtype, device=payload.tensors["values"].device)
        out[payload.meta["indices"]] = payload.tensors["values"]
        return out

    def wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return kept(numel, self.ratio) * dtype.itemsize
