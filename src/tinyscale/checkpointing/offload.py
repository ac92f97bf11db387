"""Activation offloading: tensors saved for backward go to host memory and come back for it.

    with offload_to_host():             # around the forward only: packing happens there
        loss = model(idx, targets)
    loss.backward()                     # each saved tensor is copied back when its node runs

The same trade as checkpointing, paid in transfer instead of arithmetic: device memory for
saved activations drops to (almost) nothing, and every saved byte crosses the host link twice
(device -> host in forward, host -> device in backward). On a GPU the host copy is pinned,
so the copy back can run asynchronously; `torch.autograd.graph.save_on_cpu` does the same.
**On a CPU-only machine "host" and "device" are the same memory: offloading is then a pure
copy, saves nothing and costs time.** It runs here so its gradients can be checked.

Parameters (and views of them, like the `weight.t()` a Linear saves) are left alone: they
live on the device anyway, so copying them would move bytes and save none.
Lesson: lessons/05-activation-checkpointing.md. Tests: `pytest -k activation_checkpoint`.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import saved_tensors_hooks


def _is_parameter(t: torch.Tensor) -> bool:
    """A leaf that requires grad (a parameter, or an input you asked gradients of), or a view of one.
    A leaf may itself be a view of a tensor that does not require grad: a pipeline stage's received
    input is a view of the message frame it arrived in, made a leaf by `requires_grad_()`."""
    if t.is_leaf and t.requires_grad:
        return True
    base = t._base
    return base is not None and base.is_leaf and base.requires_grad


# --8<-- [start:offload]
def _pack_to_host(t: torch.Tensor):
    if _is_parameter(t):
        return t  # stays where it is: a parameter lives on the device anyway
    pin = t.is_cuda  # pinned host memory makes the copy back asynchronous
    host = torch.empty_like(t, device="cpu", pin_memory=pin)  # empty_like keeps t's strides
    host.copy_(t)  # device -> host, synchronous: t may be freed as soon as we return
    return t.device, host


def _unpack_from_host(packed):
    if torch.is_tensor(packed):  # a parameter, never moved
        return packed
    device, host = packed
    return host.to(device, non_blocking=host.is_pinned())


class offload_to_host(saved_tensors_hooks):
    """Context manager: tensors saved for backward inside it are kept in host memory."""

    def __init__(self) -> None:
        super().__init__(_pack_to_host, _unpack_from_host)
# --8<-- [end:offload]
