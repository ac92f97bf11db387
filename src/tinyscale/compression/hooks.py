"""Compressors as DDP communication hooks, for torch's DDP and for ours.

    state = CompressionState(TopK(0.01), group)          # error feedback on by default
    torch_ddp.register_comm_hook(state, compression_hook)
    our_ddp.register_comm_hook(state, compression_hook)  # tinyscale.data_parallel.BucketedDDP

A hook has torch's signature, `hook(state, bucket) -> Future[Tensor]`: `bucket.buffer()` is
the bucket's flat gradients as this rank computed them (not yet divided by the world size),
`bucket.parameters()` says whose they are; the future's value is what every rank will use as the bucket's
averaged gradient. Both DDPs copy it back into `.grad`.

These hooks run their collectives when called and return a completed future, so the bucket's
communication is not overlapped with the rest of backward (torch's own hooks chain futures
to keep the overlap; the math is the same). Residuals for error feedback are kept per
parameter, because torch's DDP rebuilds its buckets (new order) after the first step.

Lesson: lessons/10-compression.md. Tests: `pytest -k compression_hook`.
"""

# No `from __future__ import annotations`: torch's DDP checks a hook's return annotation
# against the type itself (torch.futures.Future[torch.Tensor]), not its string.

import torch
import torch.distributed as dist

from tinyscale.compression.base import Compressor, completed, compressed_mean, split_like
from tinyscale.compression.feedback import ErrorFeedback
from tinyscale.dist import comm


class CompressionState:
    """A compressor, its process group, and (optionally) error-feedback residuals, kept per
    parameter so that a bucket rebuilt with another order or other members keeps them."""

    def __init__(self, compressor: Compressor, process_group=None, *, error_feedback: bool = True):
        self.compressor, self.process_group = compressor, process_group
        self.feedback = ErrorFeedback(compressor) if error_feedback else None
        self.residuals: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> its residual, flat

    def state_dict(self) -> dict:
        """Residuals (parameter -> tensor; each step replaces them, never writes into them) and
        the compressor's state: what a dropped step must restore, and a resume load."""
        return {"residuals": dict(self.residuals), "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.residuals = dict(state["residuals"])
        self.compressor.load_state_dict(state["compressor"])

    def mean(self, flat: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        """The compressed mean over the group of this rank's `flat` (n,), the gradients of
        `params` concatenated in order."""
        if self.feedback is None:
            return compressed_mean(flat, self.compressor, self.process_group)
        residual = torch.cat([self.residuals.get(p, flat.new_zeros(p.numel())) for p in params])  # bucket order
        payload, rest = self.feedback.compress_with(flat, residual, self.process_group)
        for p, piece in zip(params, split_like(rest, [p.reshape(-1) for p in params])):
            self.residuals[p] = piece
        return compressed_mean(flat, self.compressor, self.process_group, payload=payload)


# --8<-- [start:hook]
def compression_hook(state: CompressionState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's gradients, compressed, averaged over the group."""
    flat = bucket.buffer()  # (n,) this rank's gradients, summed not averaged
    return completed(state.mean(flat, bucket.parameters()).to(flat.dtype))
# --8<-- [end:hook]


def allreduce_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """The uncompressed baseline with the hook signature: the exact mean over the group."""
    flat = bucket.buffer().clone()
    if dist.is_initialized():
        comm.all_reduce(flat, group=process_group)
        flat.div_(dist.get_world_size(process_group))
    return completed(flat)
