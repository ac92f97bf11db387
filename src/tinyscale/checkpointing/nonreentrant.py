"""Non-re-entrant activation checkpointing: saved-tensor hooks that save an index, not a tensor.

    y = checkpoint_nonreentrant(block, x, cos, sin)   # normal forward, but every saved tensor
    y.sum().backward()                                # becomes a number; the first unpack reruns
                                                      # block and hands out its saved tensors

`fn` runs normally with grad enabled, so autograd builds its ordinary graph: the same nodes,
the same gradient order as without checkpointing. Only what the nodes *save* changes: under
`torch.autograd.graph.saved_tensors_hooks`, the pack hook returns the tensor's position in
the order of saving (the tensor itself is dropped, and freed if nothing else holds it), and
the unpack hook, the first time backward needs any of them, reruns `fn` on the saved inputs
under a hook that collects what the rerun saves, in the same order. Backward never leaves
the one autograd pass, so `torch.autograd.grad`, inputs that need no gradient and
parameters inside `fn` all work, unlike the re-entrant variant (reentrant.py).

Early stop (`early_stop=True`, the default, as torch's `set_checkpoint_early_stop`): the rerun
ends as soon as it has saved as many tensors as the forward did, so whatever `fn` runs after
its last save is not run again: a block's MLP down projection (autograd saves an op's inputs
before running it, and nothing saves its output), an attention core's P v. early_stop=False
reruns all of `fn`. Either way the tensors handed to backward are the same ones.
torch.utils.checkpoint(use_reentrant=False) works this way; Chen et al. (2016, arXiv:1604.06174).
Lesson: lessons/05-activation-checkpointing.md. Tests: `pytest -k activation_checkpoint`.

Not done here (torch's version does it): checkpointing inside a double backward (create_graph=True).
"""

from __future__ import annotations

import torch
from torch.autograd.graph import saved_tensors_hooks

from tinyscale.checkpointing.replay import ForwardState


class _HoldInputs(torch.autograd.Function):
    """Saves the checkpoint's inputs with ctx.save_for_backward and outputs an empty tensor.

    Saving them through autograd (not as a Python reference) means outer saved-tensor hooks
    (offload, saved_bytes) see them, and an in-place change to an input after the forward is
    caught by autograd's version counter instead of silently corrupting the recomputation."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, grad):  # never called: nothing consumes the output
        return (None,) * (1 + len(ctx.saved_tensors))


# --8<-- [start:frame]
class _Frame:
    """One checkpointed call: its inputs, its forward state, and the tensors a recompute saved."""

    def __init__(self, fn, args: tuple, kwargs: dict, preserve_rng_state: bool, generators=(),
                 early_stop: bool = True) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs  # tensors are replaced at recompute
        self.early_stop = early_stop
        tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
        self.state = ForwardState.capture(tensors, preserve_rng_state, generators)
        # The anchor requires grad so the holder gets a grad_fn (which owns the saved inputs).
        anchor = torch.empty(0, requires_grad=True)
        self.holder = _HoldInputs.apply(anchor, *tensors)
        self.shapes: list[tuple[torch.Size, torch.dtype]] = []  # what forward saved, in order
        self.recomputed: dict[int, torch.Tensor] = {}

    def pack(self, tensor: torch.Tensor) -> int:
        """Forward saves `tensor`: keep its number only (and shape, to check the recompute)."""
        self.shapes.append((tensor.shape, tensor.dtype))
        return len(self.shapes) - 1

    def unpack(self, index: int) -> torch.Tensor:
        """Backward needs saved tensor `index`: recompute all of them if it is not at hand.
        Each is handed out once and dropped, so recomputed tensors die as backward moves on."""
        if index not in self.recomputed:  # first need in this backward (or a retain_graph rerun)
            self.recompute()
        return self.recomputed.pop(index)

    def recompute(self) -> None:
        inputs = iter([t.detach().requires_grad_(t.requires_grad) for t in self.holder.grad_fn.saved_tensors])
        args = [next(inputs) if torch.is_tensor(a) else a for a in self.args]
        kwargs = {k: next(inputs) if torch.is_tensor(v) else v for k, v in self.kwargs.items()}
        saved: list[torch.Tensor] = []

        def keep(tensor: torch.Tensor) -> None:
            saved.append(tensor.detach())  # detach: no reference cycle through the rerun's graph
            if self.early_stop and len(saved) == len(self.shapes):
                raise _StopRecompute(self)  # all backward needs is back: the rest of fn is not rerun

        try:
            with self.state.replay(), torch.enable_grad(), saved_tensors_hooks(keep, _never_unpacked):
                self.fn(*args, **kwargs)
        except _StopRecompute as stop:
            if stop.frame is not self:  # not this rerun's stop: an enclosing frame's
                raise
        found = [(t.shape, t.dtype) for t in saved]
        if found != self.shapes:
            raise RuntimeError(f"checkpoint: the recomputation saved {len(found)} tensors, the forward "
                               f"{len(self.shapes)}; first difference at {_first_difference(found, self.shapes)}."
                               " fn must run the same operations on the same shapes when rerun "
                               "(no data-dependent control flow on global state)")
        self.recomputed = dict(enumerate(saved))
# --8<-- [end:frame]


class _StopRecompute(Exception):
    """Raised by a rerun's pack hook once it has every saved tensor: unwinds fn (its context
    managers restore the RNG and autocast state on the way) to the frame's recompute()."""

    def __init__(self, frame: _Frame) -> None:
        super().__init__("checkpoint: recomputation stopped early")
        self.frame = frame


def _never_unpacked(_):
    raise AssertionError("the recomputation's own graph is discarded, never backpropagated")


def _first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"#{i}: {x} vs {y}"
    return f"#{min(len(a), len(b))} (one list is longer)"


# --8<-- [start:checkpoint]
def checkpoint_nonreentrant(fn, *args, preserve_rng_state: bool = True, generators=(), early_stop: bool = True,
                            **kwargs):
    """fn(*args, **kwargs) whose saved activations are recomputed in backward, not stored.

    Keeps only the tensor arguments (positional or keyword; tensors nested in lists are
    kept by reference, unchecked). Any output structure works: autograd sees fn's own graph.
    `generators`: torch.Generators fn draws from besides torch's global ones, replayed too.
    `early_stop`: end the rerun once it has saved all the forward saved (False: rerun all of fn)."""
    if not torch.is_grad_enabled():  # nothing would be saved anyway
        return fn(*args, **kwargs)
    frame = _Frame(fn, args, kwargs, preserve_rng_state, generators, early_stop)
    with saved_tensors_hooks(frame.pack, frame.unpack):
        return fn(*args, **kwargs)
# --8<-- [end:checkpoint]
