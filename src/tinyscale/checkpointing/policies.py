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

How a policy is applied: a block (or a block's `attn`) is replaced by a module of a
subclass (`CheckpointedBlock`, `OffloadedBlock`, `SelectiveAttention`) that holds the *same*
submodules, parameters and buffers under the *same* names. So `state_dict()` keys,
`named_parameters()` and the parameter objects (and any optimizer built over them) are
unchanged, and a checkpoint written with one policy loads under another. Apply a policy
before anything registers hooks on the blocks (ZeRO-3, DDP): a replaced module's own hooks
would be lost, so that raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import nn

from tinyscale.checkpointing.api import checkpoint
from tinyscale.checkpointing.offload import offload_to_host
from tinyscale.models.gpt import Attention, Block

POLICIES = ("none", "full", "every_k", "selective", "offload")
# checkpoint() options of a module built directly (apply_policy sets its own per module); read-only.
_DEFAULT_OPTIONS = MappingProxyType({"use_reentrant": False, "preserve_rng_state": True})


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


# --8<-- [start:modules]
class CheckpointedBlock(Block):
    """A GPT block whose whole forward runs under checkpoint(): it saves its input only."""

    _checkpoint_options = _DEFAULT_OPTIONS

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
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

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return checkpoint(super().core, q, k, v, **self._checkpoint_options)  # (B, H, T, D)
# --8<-- [end:modules]


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


# --8<-- [start:rebuilt-as]
def _rebuilt_as(cls: type[nn.Module], module: nn.Module, **options) -> nn.Module:
    """A new `cls` module holding module's submodules, parameters, buffers and plain
    attributes under the same names: the same model state, another forward."""
    hooked = [name for name in _HOOK_DICTS if getattr(module, name, None)]
    if hooked:
        raise ValueError(f"{type(module).__name__} has hooks ({', '.join(hooked)}) that replacing it "
                         "would drop: apply the checkpointing policy before wrapping the model "
                         "(ZeRO-3, DDP) or registering hooks on its blocks")
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    for key, value in vars(module).items():
        if not key.startswith("_"):  # training, dropout, head_dim, ...: not nn.Module internals
            setattr(new, key, value)
    for name, param in module._parameters.items():  # same order as before: named_parameters()
        new.register_parameter(name, param)         # and state_dict() keep their order too
    for name, buf in module._buffers.items():
        new.register_buffer(name, buf, persistent=name not in module._non_persistent_buffers_set)
    for name, child in module._modules.items():
        new.add_module(name, child)
    if options:
        new._checkpoint_options = options  # underscore: not carried over by a later rebuild
    return new
# --8<-- [end:rebuilt-as]


def _blocks(model: nn.Module) -> nn.ModuleList:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or not all(isinstance(b, Block) for b in blocks):
        raise ValueError(f"apply_policy needs a tinyscale GPT (`blocks`: an nn.ModuleList of Block), got "
                         f"{type(model).__name__}: for another model call checkpoint() in its forward")
    return blocks


# --8<-- [start:apply-policy]
def apply_policy(model: nn.Module, policy: str | CheckpointPolicy = "none", *, every_k: int | None = None,
                 use_reentrant: bool = False, preserve_rng_state: bool = True) -> nn.Module:
    """Give the GPT `model` exactly this policy (replacing any earlier one), in place."""
    if not isinstance(policy, CheckpointPolicy):
        policy = CheckpointPolicy(policy, every_k, use_reentrant, preserve_rng_state)
    blocks = _blocks(remove_policy(model))
    options = dict(use_reentrant=policy.use_reentrant, preserve_rng_state=policy.preserve_rng_state)
    for i in policy.block_indices(len(blocks)):
        if policy.name == "selective":
            blocks[i].attn = _rebuilt_as(SelectiveAttention, blocks[i].attn, **options)
        elif policy.name == "offload":
            blocks[i] = _rebuilt_as(OffloadedBlock, blocks[i])
        else:  # full, every_k
            blocks[i] = _rebuilt_as(CheckpointedBlock, blocks[i], **options)
    return model
# --8<-- [end:apply-policy]


def remove_policy(model: nn.Module) -> nn.Module:
    """Back to plain Block and Attention modules (same parameters), in place."""
    blocks = _blocks(model)
    for i, block in enumerate(blocks):
        if type(block.attn) is SelectiveAttention:
            block.attn = _rebuilt_as(Attention, block.attn)
        if type(block) in (CheckpointedBlock, OffloadedBlock):
            blocks[i] = _rebuilt_as(Block, block)
    return model


def policy_of(model: nn.Module) -> list[str]:
    """Per block, what runs differently: "plain", "checkpointed", "offloaded" or "selective"."""
    kinds = {CheckpointedBlock: "checkpointed", OffloadedBlock: "offloaded"}
    return [kinds.get(type(b), "selective" if type(b.attn) is SelectiveAttention else "plain")
            for b in _blocks(model)]
