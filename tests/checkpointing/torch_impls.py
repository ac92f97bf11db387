"""torch.utils.checkpoint behind the seam's interface `impl(fn, *args, **kwargs)`, so the
activation-checkpointing tests hold PyTorch's own variants to the same properties as ours."""

from __future__ import annotations

from torch.utils.checkpoint import checkpoint


def torch_nonreentrant(fn, *args, preserve_rng_state: bool = True, **kwargs):
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)


def torch_reentrant(fn, *args, preserve_rng_state: bool = True, **kwargs):
    if kwargs:  # torch's re-entrant variant raises on keyword arguments: bind them
        raise TypeError("torch.utils.checkpoint(use_reentrant=True) takes no keyword arguments")
    return checkpoint(fn, *args, use_reentrant=True, preserve_rng_state=preserve_rng_state)
