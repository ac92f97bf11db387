"""`checkpoint(fn, *args, use_reentrant=..., **kwargs)`: the one entry point to both variants.

Same call as torch.utils.checkpoint.checkpoint, and like it, `use_reentrant` has no default:
the two variants differ in what they support (see reentrant.py's docstring), so the caller
chooses. Lesson: lessons/05-activation-checkpointing.md. Tests: `pytest -k activation_checkpoint`.
"""

from __future__ import annotations

from tinyscale.checkpointing.nonreentrant import checkpoint_nonreentrant
from tinyscale.checkpointing.reentrant import checkpoint_reentrant


def checkpoint(fn, *args, use_reentrant: bool, preserve_rng_state: bool = True, generators=(), **kwargs):
    """fn(*args, **kwargs) without keeping fn's internal activations: they are recomputed in
    backward, with the forward's RNG (dropout masks) and autocast state replayed: torch's global
    generators, and `generators`, any torch.Generator of the model's own that fn draws from
    (a tensor-parallel RNG tracker's stream).

    use_reentrant=False (recommended): saved-tensor hooks, one autograd pass, works with
    torch.autograd.grad and with inputs that need no gradient. use_reentrant=True: an
    autograd Function that reruns fn and backpropagates it inside its own backward."""
    if not isinstance(use_reentrant, bool):
        raise ValueError(f"use_reentrant={use_reentrant!r}: pass True or False (False is recommended)")
    variant = checkpoint_reentrant if use_reentrant else checkpoint_nonreentrant
    return variant(fn, *args, preserve_rng_state=preserve_rng_state, generators=generators, **kwargs)
