"""Clipping by the global gradient norm in every layout, read from the placements.

    norm = GradNorm(engine)                      # once the engine is built (lazily, at the first clip)
    norm.clip_(max_norm, [(param, grad), ...])   # stage 0: the model's (or fp32 masters') gradients
    norm.clip_shards_(max_norm)                  # ZeRO 1-3: this rank's gradient shards

The norm is the full model's: every element of its gradient counted exactly once over the world.
`tinyscale.engine.plan.placements` says which elements this rank counts: a tensor-parallel shard
by its TP rank (its vocab padding never), a parameter every TP rank holds (norm weights) by TP
rank 0, a K/V head copied on t/K ranks by its first copy, a tied table on the first pipeline
stage only (the last stage holds a copy). Each rank squares the gradients of what it counts, in
float64, and the squares are summed over the ranks that hold different pieces:

- stage 0 (DDP, or the fp32 masters of mixed precision): the dp x cp ranks hold the same reduced
  gradients, so the sum runs over the pipeline group and then the TP group (one all-reduce each,
  none on an axis of degree 1): a plain data-parallel rank needs no collective at all; expert
  shards (`parallel.expert`, engine/expert.py) differ between the ranks of an ep group, so their
  squares are first summed over it (one more all-reduce);
- ZeRO 1-3: a rank holds its slice of its TP rank's and stage's gradients, so the sum runs over
  the whole world (one all-reduce).

Then every rank scales by the same factor, torch's `clip_grad_norm_` rule
min(1, max_norm / (norm + 1e-6)) (Megatron's `clip_grad_norm_fp32` sums the same way).
`pytest -k layout_plan` checks the squares against one process's norm in 8 layouts, the layout
matrix (`-k layout_matrix`) trains every layout with clipping that binds at every step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tinyscale.dist import comm
from tinyscale.engine.plan import placements


class GradNorm:
    """Which elements of each gradient this rank counts, and the groups that sum the squares."""

    def __init__(self, engine) -> None:
        table = placements(engine)
        aliases = engine.pipeline.aliases if engine.pipeline is not None else {}
        # id(param) -> how many leading elements of its flat local gradient this rank counts (0: none)
        self.counted: dict[int, int] = {}
        for name, param in engine.model.named_parameters():
            if param.requires_grad:
                place = table[aliases.get(name, name)]
                self.counted[id(param)] = place.real_local_elements if place.tp_counted and place.pp_counted else 0
        self.sharded = engine.zero.sharded if engine.zero is not None else None
        mesh = engine.mesh
        if mesh is None:
            self.groups: list = []
        elif self.sharded is not None:
            self.groups = [None]  # the world: the shards of one gradient are spread over dp x cp too
        else:
            self.groups = [mesh.group(axis) for axis in ("pp", "tp") if mesh.size(axis) > 1]
        self.device = engine.device
        # stage 0 with expert shards (engine/expert.py): the dp ranks of an ep group hold different
        # experts, so their squares are summed over the ep group first (ZeRO's world sum has them)
        self.experts = {id(p) for p in engine.model.parameters() if getattr(p, "expert_shard", None) is not None}
        self.ep_group = None
        if self.experts and self.sharded is None:
            from tinyscale.moe import expert_groups  # noqa: PLC0415
            self.ep_group = expert_groups(mesh.layout, engine.plan.ep)[0]

    # --8<-- [start:squares]
    def squares(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
        """This rank's counted squares of (parameter, gradient) pairs, the gradient maybe its fp32 copy."""
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # (dense, expert shards)
        for param, grad in pairs:
            n = self.counted[id(param)]
            if grad is not None and n:
                total[int(id(param) in self.experts)] += grad.detach().reshape(-1)[:n].double().pow(2).sum()
        dense, experts = total[0].clone(), total[1].clone()
        if self.ep_group is not None:  # the ep group's ranks hold the other experts
            comm.all_reduce(experts, group=self.ep_group)
        return dense + experts

    def shard_squares(self) -> torch.Tensor:
        """This rank's counted squares of ZeRO's gradient shards: each fragment's elements that lie
        in the counted leading part of its parameter."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for g, fragments in zip(self.sharded.grad, self.sharded.fragments):
            for f in fragments if g is not None else ():
                end = min(f.param_start + f.end - f.start, self.counted[id(f.param)])
                if end > f.param_start:
                    total += g[f.start:f.start + end - f.param_start].double().pow(2).sum()
        return total

    def norm(self, squares: torch.Tensor) -> torch.Tensor:
        """The global norm from this rank's squares: summed over the groups, then the square root."""
        for group in self.groups:
            comm.all_reduce(squares, group=group)
        return squares.sqrt()
    # --8<-- [end:squares]

    @torch.no_grad()
    def clip_(self, max_norm: float, pairs: list[tuple[torch.Tensor, torch.Tensor | None]]) -> float:
        """Scale the gradients of `pairs` (stage 0) so the full model's norm is at most `max_norm`."""
        norm = self.norm(self.squares(pairs))
        _scale([g for _, g in pairs if g is not None], norm, max_norm)
        return norm.item()

    @torch.no_grad()
    def clip_shards_(self, max_norm: float) -> float:
        """ZeRO: scale this rank's gradient shards so the full model's norm is at most `max_norm`."""
        norm = self.norm(self.shard_squares())
        _scale([g for g in self.sharded.grad if g is not None], norm, max_norm)
        return norm.item()


def _scale(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's clip_grad_norm_ rule
    for g in grads:
        g.mul_(scale.to(g.dtype))


def counted_grad_squares(engine) -> torch.Tensor:
    """This rank's share of the squared global gradient norm, between backward and the step
    (the shards' under ZeRO, else the parameters' .grad); sum it over the norm's groups."""
    norm = GradNorm(engine)
    if norm.sharded is not None:
        return norm.shard_squares()
    return norm.squares((p, p.grad) for p in engine.params)
