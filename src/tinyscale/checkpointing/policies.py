"""Checkpointing policies for the GPT: which activations to keep, which to recompute or offload.

    model = apply_policy(GPT(cfg), "every_k", every_k=2)   # in place; returns the model
    model = apply_policy(model, "none")                     # back to plain blocks

| policy      | what changes (per block)                                 | saved per block      |
|-------------|----------------------------------------------------------|----------------------|
| `none`      | nothing                                                  | everything           |
| `full`      | every block runs under checkpoint()                      | its input only       |
| `every_k`   | blocks k-1, 2k-1, ... (every k-th) run under checkpoint()| mix of the two       |
| `selective` | only the attention core (scores, softmax, dropout, P V)  | all but the s^2 part |
| `offload`   | every block's saved tensors go to host memory            | (on the host)        |

`selective` is the selective activation recomputation of Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models" (2022, arXiv:2205.05198): the
attention core holds the 5as/h part of their per-layer sbh(34 + 5as/h) bytes and costs few
FLOPs to redo. `full` and `every_k` are Chen et al. (2016, arXiv:1604.06174).
Lesson: lessons/05-activation-checkpointing.md. Tests: `pytest -k activation_checkpoint`.

How a policy is applied: a block (or a block's `attn`) changes class in place, to a subclass
of its own class (`CheckpointedBlock`, `OffloadedBlock`, `SelectiveAttention`, mixed over
whatever class it had: a tensor-parallel block's stays underneath), as tensor parallelism and
FSDP2's `fully_shard` swap classes. It is the same object, holding the same submodules,
parameters, buffers and hooks: `state_dict()` keys, `named_parameters()`, the parameter objects
(and any optimizer built over them) are unchanged, a checkpoint written with one policy loads
under another, and every other reference to the block (a pipeline stage's list of its blocks,
tensor parallelism's hooks on `attn`) sees the policy. A model whose `blocks` hold stand-ins
without parameters for blocks kept elsewhere (a pipeline stage's model) has its own blocks
changed, counted by their place in the whole model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import nn

from tinyscale.checkpointing.api import checkpoint
from tinyscale.checkpointing.offload import offload_to_host
from tinyscale.checkpointing.saved_inputs import keep_inputs
from tinyscale.models.gpt import Attention, Block

POLICIES = ("none", "full", "every_k", "selective", "offload")
# checkpoint() options of a module built directly (apply_policy sets its own per module); read-only.
_DEFAULT_OPTIONS = MappingProxyType({"use_reentrant": False, "preserve_rng_state": True, "generators": ()})


@dataclass(frozen=True)
class CheckpointPolicy:
    """A validated policy: `name` (one of POLICIES), `every_k` (for "every_k" only), and the
    checkpoint() options `use_reentrant`, `preserve_rng_state` (no effect on "offload")."""

    name: str = "none"
    every_k: int | None = None
    use_reentrant: bool = False
    preserve_rng_state: bool = True

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"activation checkpointing policy {self.name!r} is unknown: "
                             f"choose one of {', '.join(POLICIES)}")
        if self.name == "every_k":
            k = self.every_k
            if not isinstance(k, int) or isinstance(k, bool) or k < 1:
                raise ValueError(f"every_k={k!r}: policy 'every_k' needs every_k, a positive int "
                                 "(1 checkpoints every block, 2 every second block, ...)")
        elif self.every_k is not None:
            raise ValueError(f"every_k={self.every_k!r} applies to policy 'every_k' only, not "
                             f"{self.name!r}: drop every_k or use policy 'every_k'")
        for field in ("use_reentrant", "preserve_rng_state"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field}={getattr(self, field)!r}: pass True or False")

    # --8<-- [start:block-indices]
    def block_indices(self, n_blocks: int) -> list[int]:
        """The blocks this policy changes. every_k: the k-th, 2k-th, ... (1-based), as
        torchtitan's per-layer checkpointing frequency does."""
        if self.name == "none":
            return []
        if self.name == "every_k":
            return [i for i in range(n_blocks) if i % self.every_k == self.every_k - 1]
        return list(range(n_blocks))
    # --8<-- [end:block-indices]


def _kept(where: tuple | None):
    """keep_inputs(partition group, to host) around a checkpoint, or nothing (inputs kept whole)."""
    return contextlib.nullcontext() if where is None else keep_inputs(*where)


# --8<-- [start:modules]
class CheckpointedBlock(Block):
    """A GPT block whose whole forward runs under checkpoint(): it saves its input only (whole,
    or split over the TP group and/or on the host: `_keep_inputs`, saved_inputs.py)."""

    _checkpoint_options = _DEFAULT_OPTIONS
    _keep_inputs: tuple | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        with _kept(self._keep_inputs):
            return checkpoint(super().forward, x, cos, sin, **self._checkpoint_options)


class OffloadedBlock(Block):
    """A GPT block whose saved tensors are kept in host memory (on a CPU: a copy)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        with offload_to_host():
            return super().forward(x, cos, sin)


class SelectiveAttention(Attention):
    """Attention whose core (q k^T, mask, softmax, dropout, P v) runs under checkpoint().

    Saved: the core's inputs q, k, v (s b (h + 2 kv) elements); recomputed: the (B, H, T, T)
    tensors. The projections and RoPE around it keep their activations."""

    _checkpoint_options = _DEFAULT_OPTIONS
    _keep_inputs: tuple | None = None  # never split: q, k, v are this rank's heads under TP

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with _kept(self._keep_inputs):
            return checkpoint(super().core, q, k, v, **self._checkpoint_options)  # (B, H, T, D)
# --8<-- [end:modules]

_POLICY_CLASSES = (CheckpointedBlock, OffloadedBlock, SelectiveAttention)  # what a policy puts over a class
_MIXED: dict[tuple[type, type], type] = {}  # (policy class, module's own class) -> their subclass


# --8<-- [start:with-policy]
def _own_class(module: nn.Module) -> type:
    """The module's class without any policy: the first class in its MRO no policy made."""
    return next(c for c in type(module).__mro__ if not issubclass(c, _POLICY_CLASSES))


def _with_policy(cls: type[nn.Module], module: nn.Module, keep: tuple | None = None, **options) -> nn.Module:
    """`module` itself, its class now `cls` over its own class (`cls` when that is cls's base, as
    for a plain Block; else a subclass of both, so `cls`'s forward wraps e.g. a tensor-parallel
    block's): the same object, state and hooks, another forward."""
    own = _own_class(module)
    if own is not cls.__bases__[0]:
        key = (cls, own)
        if key not in _MIXED:
            _MIXED[key] = type(f"{cls.__name__}Over{own.__name__}", (cls, own), {})
        cls = _MIXED[key]
    module.__class__ = cls
    if options:
        module._checkpoint_options = options
    if keep is not None:
        module._keep_inputs = keep
    return module


def _without_policy(module: nn.Module) -> nn.Module:
    """`module` back to its own class (the inverse of `_with_policy`), in place."""
    module.__class__ = _own_class(module)
    module.__dict__.pop("_checkpoint_options", None)
    module.__dict__.pop("_keep_inputs", None)
    return module
# --8<-- [end:with-policy]


def _blocks(model: nn.Module) -> nn.ModuleList:
    """The GPT's blocks: Blocks, or stand-ins without parameters for blocks held elsewhere (a
    pipeline stage's model keeps only its own), at least one Block."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or not any(isinstance(b, Block) for b in blocks) or not all(
            isinstance(b, Block) or not any(True for _ in b.parameters()) for b in blocks):
        raise ValueError(f"apply_policy needs a tinyscale GPT (`blocks`: an nn.ModuleList of Block), got "
                         f"{type(model).__name__}: for another model call checkpoint() in its forward")
    return blocks


# --8<-- [start:apply-policy]
def apply_policy(model: nn.Module, policy: str | CheckpointPolicy = "none", *, every_k: int | None = None,
                 use_reentrant: bool = False, preserve_rng_state: bool = True,
                 generators: Sequence[torch.Generator] = (), partition_group=None,
                 inputs_to_host: bool = False) -> nn.Module:
    """Give the GPT `model` exactly this policy (replacing any earlier one), in place.
    `generators`: the model's own torch.Generators (a tensor-parallel RNG tracker's stream),
    replayed by every recomputation like torch's global ones. `partition_group` ("full" and
    "every_k": the block inputs, equal on every rank of it, are kept split over it) and
    `inputs_to_host` (the checkpoints kept in host memory): see saved_inputs.py."""
    if not isinstance(policy, CheckpointPolicy):
        policy = CheckpointPolicy(policy, every_k, use_reentrant, preserve_rng_state)
    if partition_group is not None and policy.name not in ("full", "every_k"):
        raise ValueError(f"partition_group splits a checkpointed block's input, which policy {policy.name!r} "
                         "does not save: use policy 'full' or 'every_k'")
    if inputs_to_host and policy.name not in ("full", "every_k", "selective"):
        raise ValueError(f"inputs_to_host moves the checkpoints to the host, and policy {policy.name!r} keeps "
                         "none: use 'full', 'every_k' or 'selective' (or policy 'offload' alone)")
    blocks = _blocks(remove_policy(model))
    options = dict(use_reentrant=policy.use_reentrant, preserve_rng_state=policy.preserve_rng_state,
                   generators=tuple(generators))
    keep = (partition_group, inputs_to_host) if partition_group is not None or inputs_to_host else None
    for i in policy.block_indices(len(blocks)):
        if not isinstance(blocks[i], Block):
            continue  # a stand-in: the block lives on another rank, which applies the policy there
        if policy.name == "selective":
            _with_policy(SelectiveAttention, blocks[i].attn, keep, **options)
        elif policy.name == "offload":
            _with_policy(OffloadedBlock, blocks[i])
        else:  # full, every_k
            _with_policy(CheckpointedBlock, blocks[i], keep, **options)
    return model
# --8<-- [end:apply-policy]


def remove_policy(model: nn.Module) -> nn.Module:
    """Back to the blocks' and attentions' own classes (same objects), in place."""
    for block in _blocks(model):
        if isinstance(block, Block):
            _without_policy(block.attn)
            _without_policy(block)
    return model


def policy_of(model: nn.Module) -> list[str]:
    """Per block, what runs differently: "plain", "checkpointed", "offloaded" or "selective"
    ("elsewhere" for a stand-in of a block held by another rank)."""
    def kind(b: nn.Module) -> str:
        if not isinstance(b, Block):
            return "elsewhere"
        if isinstance(b, CheckpointedBlock):
            return "checkpointed"
        if isinstance(b, OffloadedBlock):
            return "offloaded"
        return "selective" if isinstance(b.attn, SelectiveAttention) else "plain"
    return [kind(b) for b in _blocks(model)]
