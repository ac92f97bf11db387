"""Checkpoint variants behind the seam's interface `impl(fn, *args, **kwargs)`: torch.utils.checkpoint,
so the activation-checkpointing tests hold PyTorch's own variants to the same properties as ours,
and ours with early_stop=False (the whole region rerun)."""

from __future__ import annotations

from torch.utils.checkpoint import checkpoint

from tinyscale.checkpointing import checkpoint_nonreentrant


def torch_nonreentrant(fn, *args, preserve_rng_state: bool = True, **kwargs):
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)


def torch_reentrant(fn, *args, preserve_rng_state: bool = True, **kwargs):
    if kwargs:  # torch's re-entrant variant raises on keyword arguments: bind them
        raise TypeError("torch.utils.checkpoint(use_reentrant=True) takes no keyword arguments")
    return checkpoint(fn, *args, use_reentrant=True, preserve_rng_state=preserve_rng_state)


def nonreentrant_without_early_stop(fn, *args, **kwargs):
    return checkpoint_nonreentrant(fn, *args, early_stop=False, **kwargs)
