"""Re-entrant activation checkpointing: an autograd Function that reruns `fn` in its backward.

    y = checkpoint_reentrant(block, x, cos, sin)   # forward under no_grad: nothing inside is saved
    y.sum().backward()                             # backward reruns block with grad on, backprops it

Forward runs `fn` under no_grad, so autograd records one node (this Function) and saves
only its tensor inputs. Backward *re-enters* autograd: it reruns `fn` with grad enabled on
detached copies of the inputs, calls `torch.autograd.backward` on that small graph (the
parameters inside `fn` accumulate their .grad there), and returns the inputs' gradients.
Chen et al., "Training Deep Nets with Sublinear Memory Cost" (2016, arXiv:1604.06174); the original
torch.utils.checkpoint(use_reentrant=True). Lesson: lessons/05-activation-checkpointing.md.
Tests: `pytest -k activation_checkpoint`.

What re-entrancy costs (the non-re-entrant variant in nonreentrant.py has none of these):

- The output requires grad only if a *tensor input* does: parameters hidden inside `fn`
  do not count. Checkpoint a block whose input needs no gradient (token data, a frozen
  embedding) and its parameters silently get no gradient. We warn, as torch does.
- `torch.autograd.grad(loss, inputs)` cannot work: the inner backward accumulates into
  .grad instead of returning gradients. Refused with an error.
- The whole of `fn` is recomputed even if only part of its gradient is needed.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from tinyscale.checkpointing.replay import ForwardState


_TENSOR = object()  # marks a tensor input's place among the non-tensor ones


def _detached(t: torch.Tensor) -> torch.Tensor:
    """A leaf sharing t's data, so the recomputed graph stops here and collects t's gradient."""
    return t.detach().requires_grad_(t.requires_grad)


# --8<-- [start:function]
class ReentrantCheckpoint(torch.autograd.Function):
    """apply(fn, rng, kwarg_names, *inputs): rng is (preserve_rng_state, generators); the last
    len(kwarg_names) inputs are fn's keyword arguments (a Function takes positional inputs only)."""

    @staticmethod
    def forward(ctx, fn, rng: tuple[bool, tuple], kwarg_names: tuple[str, ...], *inputs):
        tensors = [a for a in inputs if torch.is_tensor(a)]
        ctx.fn, ctx.kwarg_names = fn, kwarg_names
        ctx.state = ForwardState.capture(tensors, *rng)  # before fn draws anything
        ctx.inputs = [_TENSOR if torch.is_tensor(a) else a for a in inputs]  # non-tensors kept as is
        ctx.save_for_backward(*tensors)  # saved through autograd: outer saved-tensor hooks see them
        args, kwargs = _call_args(inputs, kwarg_names)
        return fn(*args, **kwargs)  # Function.forward runs with grad disabled: fn saves nothing

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("re-entrant checkpointing works with .backward() / torch.autograd.backward "
                               "only, not torch.autograd.grad(..., inputs=...): use use_reentrant=False")
        detached = iter([_detached(t) for t in ctx.saved_tensors])
        inputs = [next(detached) if a is _TENSOR else a for a in ctx.inputs]
        args, kwargs = _call_args(inputs, ctx.kwarg_names)
        with ctx.state.replay(), torch.enable_grad():
            outputs = ctx.fn(*args, **kwargs)  # the forward again, graph on
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(out, grad) for out, grad in zip(outputs, grad_outputs)
                 if torch.is_tensor(out) and out.requires_grad]
        if not pairs:
            raise RuntimeError("checkpoint: none of fn's outputs requires grad in the recomputation")
        torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        input_grads = tuple(a.grad if torch.is_tensor(a) and a.requires_grad else None for a in inputs)
        return (None, None, None) + input_grads  # no gradient for fn, rng, kwarg_names
# --8<-- [end:function]


def _call_args(inputs, kwarg_names: tuple[str, ...]) -> tuple[tuple, dict[str, Any]]:
    """Split apply()'s flat inputs back into (args, kwargs)."""
    split = len(inputs) - len(kwarg_names)
    return inputs[:split], dict(zip(kwarg_names, inputs[split:]))


def checkpoint_reentrant(fn, *args, preserve_rng_state: bool = True, generators=(), **kwargs):
    """fn(*args, **kwargs), saving only its tensor arguments; recomputed in backward.
    `generators`: torch.Generators fn draws from besides torch's global ones, replayed too.

    Tensor keyword arguments get gradients too (they are passed to the Function as inputs).
    Outputs: a tensor or a tuple (non-tensor elements pass through without gradient)."""
    if torch.is_grad_enabled() and not any(
            torch.is_tensor(a) and a.requires_grad for a in (*args, *kwargs.values())):
        warnings.warn("checkpoint(use_reentrant=True): no tensor input requires grad, so the output "
                      "will not either and parameters inside fn get no gradient; use use_reentrant=False",
                      stacklevel=2)
    names = tuple(kwargs)
    return ReentrantCheckpoint.apply(fn, (preserve_rng_state, tuple(generators)), names, *args, *kwargs.values())
