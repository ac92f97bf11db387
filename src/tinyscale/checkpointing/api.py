"""`checkpoint(fn, *args, use_reentrant=..., **kwargs)`: the one entry point to both variants.

Same call as torch.utils.checkpoint.checkpoint, and like it, `use_reentrant` has no default:
the two variants differ in what they support (see reentrant.py's docstring), so the caller
chooses. Inside a region Dynamo is compiling (`compile: true`, engine/compiled.py) both variants
become torch's non-reentrant checkpoint, traced into the compiled graphs (`compiled_checkpoint`).
Lesson: lessons/05-activation-checkpointing.md. Tests: `pytest -k activation_checkpoint`,
`pytest -k torch_compile_checkpointing`.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from tinyscale.checkpointing.nonreentrant import checkpoint_nonreentrant
from tinyscale.checkpointing.reentrant import checkpoint_reentrant


def checkpoint(fn, *args, use_reentrant: bool, preserve_rng_state: bool = True, generators=(), early_stop: bool = True,
               **kwargs):
    """fn(*args, **kwargs) without keeping fn's internal activations: they are recomputed in
    backward, with the forward's RNG (dropout masks) and autocast state replayed: torch's global
    generators, and `generators`, any torch.Generator of the model's own that fn draws from
    (a tensor-parallel RNG tracker's stream).

    use_reentrant=False (recommended): saved-tensor hooks, one autograd pass, works with
    torch.autograd.grad and with inputs that need no gradient. use_reentrant=True: an
    autograd Function that reruns fn and backpropagates it inside its own backward.

    early_stop (non-re-entrant only, as torch's `set_checkpoint_early_stop`): the rerun ends once
    it has every tensor backward needs, so fn's ops after its last saved tensor (a block's MLP down
    projection) are not rerun; False reruns all of fn. The re-entrant variant always reruns all
    (it backpropagates from fn's outputs); a compiled region reruns what its backward graph needs."""
    if not isinstance(use_reentrant, bool):
        raise ValueError(f"use_reentrant={use_reentrant!r}: pass True or False (False is recommended)")
    if torch.compiler.is_compiling():  # Dynamo is tracing fn's caller (compile: true, engine/compiled.py)
        return compiled_checkpoint(fn, *args, preserve_rng_state=preserve_rng_state, **kwargs)
    if use_reentrant:
        return checkpoint_reentrant(fn, *args, preserve_rng_state=preserve_rng_state, generators=generators, **kwargs)
    return checkpoint_nonreentrant(fn, *args, preserve_rng_state=preserve_rng_state, generators=generators,
                                   early_stop=early_stop, **kwargs)


# --8<-- [start:compiled-checkpoint]
def compiled_checkpoint(fn, *args, preserve_rng_state: bool = True, **kwargs):
    """The checkpoint inside a compiled region: torch's non-reentrant checkpoint, which Dynamo
    traces as a higher-order op, tagging each op of fn "recompute" in the joint forward and
    backward graph; AOTAutograd's partitioner then keeps fn's inputs and puts fn's ops again in
    the backward graph, where they run before the gradients that need them. Ours (saved-tensor
    hooks that Python runs at unpack time) cannot enter that graph. RNG: each random op that
    the backward graph reruns gets the generator state it had in the forward (saved beside the
    inputs: run_with_rng_state), so masks are replayed as preserve_rng_state does eagerly."""
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state,
                                             **kwargs)
# --8<-- [end:compiled-checkpoint]
