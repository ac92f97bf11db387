"""The pipeline transform for the engine: keep this rank's stages of a GPT, drop the rest.

    stages = apply_pipeline(model, plan, rank)      # in place; model keeps the original names
    state = gather_full_state(model, like, plan, rank, ranks, group)   # the inverse: full_state_dict()

`apply_pipeline` builds this rank's `GPTStage`s (`executor.py`) from `plan`
(`partition.partition_gpt`), then replaces every module of `model` that lives on another
pipeline rank by a parameter-free `OnAnotherRank`, as torchtitan's pipeline split deletes
the layers a stage does not run. What remains is `model` holding only this rank's
parameters under the original model's names (``blocks.3.attn.wq.weight`` stays
``blocks.3...``), so the engine's optimizer, DDP or ZeRO build over them and checkpoints and
`full_state_dict` keep the original keys. A tied embedding/head (one Parameter in the GPT)
stays on both the first stage's rank (``embed.weight``) and the last's (``head.weight``):
two copies of one value, kept equal by summing their gradients (`exchange_tied_grads`).

Tests: `pytest tests/engine/test_engine_pipeline.py` (keys engine_pipeline, pp_afab, pp_1f1b,
pp_interleaved, pp_zero_bubble).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tinyscale.dist import comm
from tinyscale.models.gpt import GPT
from tinyscale.pipeline.executor import GPTStage
from tinyscale.pipeline.partition import StageLayers, stages_on_rank


class OnAnotherRank(nn.Module):
    """Stands where a module of another pipeline rank was: no parameters; calling it is an error."""

    def __init__(self, name: str, rank: int) -> None:
        super().__init__()
        self.name, self.rank = name, rank

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} lives on pipeline rank {self.rank}: with parallel.pipeline > 1 this "
                           "model holds one rank's stages only, which the engine's pipeline schedule runs")

    def extra_repr(self) -> str:
        return f"{self.name} on pipeline rank {self.rank}"


def apply_pipeline(model: GPT, plan: Sequence[StageLayers], rank: int) -> dict[int, GPTStage]:
    """Keep pipeline rank `rank`'s stages of `model` (in place); returns them by stage index."""
    stages = {spec.stage: GPTStage(model, spec) for spec in stages_on_rank(list(plan), rank)}
    first, last = plan[0], plan[-1]
    block_rank = {i: spec.rank for spec in plan for i in spec.layers}
    for i, block_on in block_rank.items():
        if block_on != rank:
            model.blocks[i] = OnAnotherRank(f"blocks.{i}", block_on)
    if first.rank != rank:
        model.embed = OnAnotherRank("embed", first.rank)
    if last.rank != rank:  # the final norm and the head (a tied head's weight: rank first.rank's copy)
        model.norm = OnAnotherRank("norm", last.rank)
        model.head = OnAnotherRank("head", last.rank)
    return stages


def owner(key: str, plan: Sequence[StageLayers]) -> int | None:
    """The pipeline rank holding state_dict entry `key` of the GPT, or None if every rank does."""
    top, _, rest = key.partition(".")
    if top == "blocks":
        i = int(rest.partition(".")[0])
        return next(spec.rank for spec in plan if i in spec.layers)
    if top == "embed":
        return plan[0].rank
    if top in ("norm", "head"):
        return plan[-1].rank
    return None


@torch.no_grad()
def gather_full_state(model: nn.Module, like: dict[str, tuple[torch.Size, torch.dtype]], plan: Sequence[StageLayers],
                      rank: int, ranks: Sequence[int], group=None,
                      local: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The full model's state on CPU on every pipeline rank, keyed and ordered like `like` (the
    original model's state_dict keys, each with its shape and dtype): each entry is broadcast
    over the pp `group` by the rank holding it (`ranks[r]`: global rank of pipeline rank r),
    through `tinyscale.dist.comm` so the ledger sees it. `local` replaces `model.state_dict()`
    as this rank's entries (the engine passes the TP shards gathered back to full tensors)."""
    local = model.state_dict() if local is None else local
    device = next(iter(local.values())).device
    out = {}
    for key, (shape, dtype) in like.items():
        src = owner(key, plan)
        if src is None:  # on every rank alike (no stage module's)
            tensor = local[key]
        else:
            tensor = local[key] if src == rank else torch.empty(shape, dtype=dtype, device=device)
            tensor = tensor.detach().contiguous()
            comm.broadcast(tensor, src=ranks[src], group=group)
        out[key] = tensor.detach().to("cpu", copy=True)
    return out
