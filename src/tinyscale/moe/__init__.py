"""Mixture of experts and expert parallelism.

| file | what |
| --- | --- |
| `router.py` | softmax / sigmoid top-k gate, capacity and dropped assignments, Switch aux loss, z-loss |
| `dispatch.py` | all-to-all dispatch and combine (autograd: backward is the reverse all-to-all) |
| `layer.py` | the MoE feed-forward: router, stacked SwiGLU experts (grouped GEMM), shared experts |
| `parallel.py` | ep groups inside dp, and the transform that gives each rank its experts |

Turn it on in the GPT with `GPTConfig(moe_experts=8, moe_top_k=2, moe_capacity_factor=1.25)`;
expert parallelism in the engine with `parallel.expert`. Depends on tinyscale.dist and
tinyscale.kernels (the grouped GEMM). Lesson: lessons/13-moe.md. Tests: `pytest tests/moe`.
"""

from tinyscale.moe.dispatch import AllToAll, DispatchPlan, all_to_all_bytes, combine, dispatch
from tinyscale.moe.layer import MoE, MoEStats, AddAuxLoss, Experts, aux_loss_of, moe_layers, moe_stats
from tinyscale.moe.parallel import (
    ExpertShard, apply_expert_parallel, expert_group_ranks, expert_groups, expert_shard, reduce_expert_gradients,
    shard_experts,
)
from tinyscale.moe.router import ROUTERS, Routing, capacity, gate, route

__all__ = [
    "ROUTERS", "AddAuxLoss", "AllToAll", "DispatchPlan", "ExpertShard", "Experts", "MoE", "MoEStats", "Routing",
    "all_to_all_bytes", "apply_expert_parallel", "aux_loss_of", "capacity", "combine", "dispatch",
    "expert_group_ranks", "expert_groups", "expert_shard", "gate", "moe_layers", "moe_stats",
    "reduce_expert_gradients", "route",
    "shard_experts",
]
