"""Expert parallelism as a transform: the ep groups inside dp, and each rank's share of the experts.

    ep_group, edp_group = expert_groups(mesh, ep)     # collective: every rank, same order
    apply_expert_parallel(model, ep_group)           # each MoE layer computes E / ep experts here
    shard_experts(model, edp_group, dp)              # ... and stores only those (tagged ExpertShard)

The ep axis lives inside dp (DeepSpeed-MoE's and Megatron's layout): the dp ranks of one
(pp, cp, tp) coordinate are cut into runs of ep consecutive dp ranks; each run is an ep group,
whose ranks hold different experts and exchange tokens by all-to-all. The ranks holding the
same experts (the same place in their runs, dp / ep of them) form the expert-data-parallel
group. With dp = 4, ep = 2: ep groups {0, 1}, {2, 3}; expert-data-parallel groups {0, 2}, {1, 3}.

`apply_expert_parallel` keeps every expert tensor whole on every rank and sets which of them
this rank computes (`Experts.local`): the forward's work and its all-to-all are expert
parallelism's, and the gradient of the experts this rank did not compute is zero here, so a
reduction over dp (which sums every rank's gradient) would add, for each expert, exactly the
contributions of the ranks that computed it (exact, but every rank stores every expert).

`shard_experts` then keeps only this rank's E / ep experts (the engine always does:
engine/expert.py). After backward the dense gradients are averaged over dp as always, and each
expert shard's gradient is summed over the expert-data-parallel group (the dp / ep ranks holding
the same experts) and divided by dp: every dp rank's tokens reached the expert through one of
the ep groups, so that sum is every rank's contribution, once (`reduce_expert_gradients`; in the
engine DDP and ZeRO read the `ExpertShard` tag and do it themselves).

Lesson: lessons/13-moe.md. Tests: `pytest tests/moe -k expert_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from tinyscale.dist import comm
from tinyscale.dist.mesh import MeshLayout
from tinyscale.moe.layer import moe_layers

_groups: dict[tuple, tuple] = {}  # creating groups is collective: once per (layout, ep, world)


# --8<-- [start:groups]
def expert_group_ranks(layout: MeshLayout, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(every ep group, every expert-data-parallel group) as lists of global ranks (pure arithmetic)."""
    if layout.dp % ep:
        raise ValueError(f"ep={ep} must divide dp={layout.dp}: the ep groups are runs of ep dp ranks")
    ep_groups, edp_groups = [], []
    for dp_group in layout.groups("dp"):  # one per (pp, cp, tp) coordinate, in dp order
        runs = [dp_group[i:i + ep] for i in range(0, len(dp_group), ep)]
        ep_groups += runs
        edp_groups += [[run[j] for run in runs] for j in range(ep)]
    return ep_groups, edp_groups
# --8<-- [end:groups]


def expert_groups(layout: MeshLayout, ep: int):
    """This rank's (ep group, expert-data-parallel group) process groups (collective, cached)."""
    key = (layout.shape, ep, id(dist.group.WORLD))
    if key not in _groups:
        ep_ranks, edp_ranks = expert_group_ranks(layout, ep)
        ep_group, _ = dist.new_subgroups_by_enumeration(ep_ranks)
        edp_group, _ = dist.new_subgroups_by_enumeration(edp_ranks)
        _groups[key] = (ep_group, edp_group)
    return _groups[key]


# --8<-- [start:apply]
def apply_expert_parallel(model: nn.Module, group) -> nn.Module:
    """Every MoE layer of `model` computes its E / ep experts on this rank of `group`, in place."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    for layer in moe_layers(model):
        if layer.num_experts % ep:
            raise ValueError(f"ep={ep} must divide the number of experts {layer.num_experts}")
        per_rank = layer.num_experts // ep
        layer.ep_group = group
        layer.experts.local = (rank * per_rank, (rank + 1) * per_rank)
    return model
# --8<-- [end:apply]


EXPERT_PARAMS = ("w_gate", "w_up", "w_down")


@dataclass(frozen=True)
class ExpertShard:
    """What a stored expert shard tells data parallelism (DeepSpeed-MoE tags its expert parameters
    the same way, `param.allreduce = False` and `group_name`): it is reduced, and ZeRO-sharded, over
    `group` (the expert-data-parallel ranks holding the same experts) and averaged over `mean_over`
    ranks (dp: every dp rank's tokens reached it through one of the ep groups); it holds experts
    `experts` = [start, stop) of the `num_experts` of the stacked tensor (dim 0)."""

    group: object
    mean_over: int
    experts: tuple[int, int]
    num_experts: int


def expert_shard(param) -> ExpertShard | None:
    """The tag `shard_experts` put on `param`, or None for every other parameter."""
    return getattr(param, "expert_shard", None)


# --8<-- [start:shard]
def shard_experts(model: nn.Module, edp_group=None, dp_size: int | None = None) -> nn.Module:
    """After `apply_expert_parallel`: keep only this rank's experts (dim 0 of each expert tensor), in place.
    `Experts.first` is then the global index of the first one held. With `edp_group` (the engine),
    each shard is tagged for the data-parallel machinery (`expert_shard`): reduced and ZeRO-sharded
    over `edp_group`, its gradient averaged over the `dp_size` ranks of dp."""
    for layer in moe_layers(model):
        ex = layer.experts
        start, stop = ex.local
        for name in EXPERT_PARAMS:
            full = getattr(ex, name)
            shard = nn.Parameter(full.detach()[start:stop].clone(), requires_grad=full.requires_grad)
            if edp_group is not None:
                shard.expert_shard = ExpertShard(edp_group, dp_size, (start, stop), layer.num_experts)
            setattr(ex, name, shard)
        ex.local, ex.first = (0, stop - start), start
    return model


def reduce_expert_gradients(model: nn.Module, edp_group, dp_size: int) -> None:
    """Expert shards' gradients: summed over the expert-data-parallel group, divided by dp (the
    dense parameters' mean over dp is the caller's, as in any data parallelism)."""
    for layer in moe_layers(model):
        for name in EXPERT_PARAMS:
            grad = getattr(layer.experts, name).grad
            if grad is not None:
                if dist.get_world_size(edp_group) > 1:
                    comm.all_reduce(grad, group=edp_group)
                grad.div_(dp_size)
# --8<-- [end:shard]
