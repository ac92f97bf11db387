"""What a recomputation must replay to be the same computation: RNG and autocast state.

Recomputing a forward inside backward gives the same tensors only if every random draw and
every dtype decision is the same as the first time:

- **RNG.** Dropout draws its mask from the global generator (CPU, or one per CUDA device).
  Recompute with the generator wherever the rest of the forward left it and the mask is a
  different one: the gradient is then the gradient of a network nobody ran. So capture
  the state before the first run, set it back for the recomputation, and afterwards put
  back whatever the state was, so the recomputation does not shift the masks of anything
  that runs later (`torch.random.fork_rng` does the putting back). A model that draws from
  generators of its own (tensor parallelism's per-rank stream, Megatron's RNG tracker) names
  them (`generators`): torch's global state says nothing about them, so they are captured and
  replayed the same way, or the recomputed masks of a sharded activation would be new ones.
- **Autocast.** Backward normally runs after the `autocast` region has exited; a
  recomputation outside it would redo the matmuls in float32 and save different tensors.

Chen et al., "Training Deep Nets with Sublinear Memory Cost" (2016, arXiv:1604.06174),
the recomputation from a checkpoint; torch.utils.checkpoint's `preserve_rng_state` does the same.
Lesson: lessons/05-activation-checkpointing.md. Tests: `pytest -k activation_checkpoint`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch


def _autocast_device_types() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


# --8<-- [start:forward-state]
@dataclass
class ForwardState:
    """RNG and autocast state at the start of a checkpointed forward, to replay for recompute."""

    cpu_rng: torch.Tensor | None  # None: preserve_rng_state=False
    cuda_rng: dict[int, torch.Tensor]  # CUDA device index -> that device's generator state
    autocast: dict[str, tuple[bool, torch.dtype]]  # device type -> (enabled, dtype)
    generators: list[tuple[torch.Generator, torch.Tensor]]  # the model's own generators, their states

    @classmethod
    def capture(cls, tensors: Iterable[torch.Tensor], preserve_rng_state: bool,
                generators: Iterable[torch.Generator] = ()) -> ForwardState:
        """Call before running the forward. CUDA generators are captured for the devices that
        `tensors` (the inputs) live on, as in torch.utils.checkpoint: a function drawing on
        another device's generator is not covered; `generators` (e.g. a tensor-parallel RNG
        tracker's) are captured too."""
        cpu_rng, cuda_rng, own = None, {}, []
        if preserve_rng_state:
            cpu_rng = torch.get_rng_state()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                for index in sorted({t.device.index for t in tensors if t.is_cuda}):
                    cuda_rng[index] = torch.cuda.get_rng_state(index)
            own = [(g, g.get_state()) for g in generators]
        autocast = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                    for d in _autocast_device_types()}
        return cls(cpu_rng, cuda_rng, autocast, own)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the recomputation inside this: the captured RNG and autocast state apply, and
        on exit every generator is back where it was before (fork_rng restores in finally)."""
        with torch.random.fork_rng(devices=list(self.cuda_rng), enabled=self.cpu_rng is not None), \
                contextlib.ExitStack() as stack:
            if self.cpu_rng is not None:
                torch.set_rng_state(self.cpu_rng)
                for index, state in self.cuda_rng.items():
                    torch.cuda.set_rng_state(state, index)
            for generator, state in self.generators:  # fork_rng's job for the model's own streams
                stack.callback(generator.set_state, generator.get_state())
                generator.set_state(state)
            for device_type, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
            yield
# --8<-- [end:forward-state]
