"""Expert parallelism and MoE models in the engine: `parallel.expert`.

    {"parallel": {"expert": 2}}     # an MoE GPT (GPTConfig.moe_experts > 0), experts split over 2 ranks

The ep axis lives inside dp (DeepSpeed-MoE's and Megatron's layout; `tinyscale.moe.parallel`):
each (pp, cp, tp) coordinate's dp ranks are cut into runs of ep consecutive dp ranks, the ep
groups; with tensor parallelism the ep group is made of ranks with the same tp coordinate,
with a pipeline of ranks with the same stages. Placed in the engine's order after the pipeline
partition and tensor parallelism (`apply`, called by `engine/parallelize.py`): the MoE layers
of this rank's stages each compute E / ep experts and exchange tokens over the ep group by
all-to-all. Every rank routes its own micro-batch's tokens (capacity and the aux losses from
its own tokens, as one process routes each micro-batch), so the layout equals one process.

Parameters: attention, norms, embeddings, the routers and shared experts are data-parallel as
before (replicated over dp, reduced and ZeRO-sharded over it; split by tp where tp splits them).
Each rank stores only its E / ep experts (`tinyscale.moe.shard_experts`, DeepSpeed-MoE's and
Megatron's layout): the stacked expert tensors are cut along dim 0, and each shard is tagged
(`tinyscale.moe.ExpertShard`) with its expert-data-parallel group, the dp / ep ranks holding the
same experts. Data parallelism reads the tag: DDP leaves the shards out of its buckets and, once
its own reduction is done, sums each shard's gradient over its edp group and divides by dp
(`data_parallel/base.py`: every dp rank's tokens reached the experts through one of the ep
groups, so that is the mean over the global batch; sent in `communication_data_type` and divided
before / after the sum as `prescale_gradients` / `gradient_predivide_factor` say, as the buckets are);
ZeRO 1-3 put the shards in FlatUnits of their
own, reduce-scattered, sharded and gathered over the edp group and averaged over dp
(`ShardedOptimizer._split`, DeepSpeed's separate MoE parameter groups). The placements say it
(`Placement.ep_range`: the experts held, `reduce_over="edp"`; `expert_fields`), and from them
clipping counts each expert once (at stage 0 the expert squares are summed over the ep group,
`engine/grad_norm.py`), `full_state_dict` and DCP checkpoints place each shard by its first
expert (a checkpoint reshards across ep degrees), and `layout_memory` counts E / ep experts per
rank. Under ZeRO-3 a rank's expert bytes are the same as when every rank kept every expert
(E X / dp either way); the saving there is in the gathers (E / ep experts, over dp / ep ranks).
A DDP compression hook (`compression.type` topk, powersgd, ...) compresses the buckets only: the
expert shards are reduced uncompressed over their edp group. Measured: benchmarks/moe_expert_bytes.py.
The engine's failure watch (engine/step_failure.py) covers the ep group (`watched`): a rank that
raises between two all-to-alls leaves its ep peers waiting there; they give up in bounded time and
every rank stops naming it (a rank that raised after the step's last all-to-all: the step is dropped).
Tests of these and of bf16 / fp16 with ep > 1: tests/moe/test_moe_engine_steps.py.

Under a pipeline the loss is computed on the last stage only, so each MoE layer adds its aux
loss's gradient itself (`tinyscale.moe.AddAuxLoss`, scaled as the executor scales the loss:
S / m) and the aux losses' values join the reported loss (`take_aux` after each forward action).

ZeRO 0-3, tensor parallelism (without SP), every pipeline schedule and non-re-entrant activation
checkpointing (a full checkpoint runs the forward's all-to-alls again in backward) compose with it.
Refused, with the reason (`check_layout`, run by `plan_layout`): `parallel.expert` > 1 without an MoE
GPT, or with an ep that divides neither dp nor the expert count, or with 1-bit Adam (which
averages every parameter over dp itself); an MoE GPT with context
parallelism or sequence parallelism (each rank would route a slice of the sequence: capacity
and the aux loss are functions of the whole micro-batch's routing, so they would differ from one
process), and with re-entrant activation checkpointing (its forward runs without autograd, so
the aux losses, which leave the block beside its output, would not train the router).
Lesson: lessons/13-moe.md. Tests: `pytest tests/moe -k "moe_engine or expert_parallel"`.
"""

from __future__ import annotations

import torch

from tinyscale.config import ConfigError, EngineConfig
from tinyscale.dist import ParallelMesh
from tinyscale.models.gpt import GPT
from tinyscale.moe import apply_expert_parallel, expert_groups, expert_shard, moe_layers, shard_experts


def _is_moe(model) -> bool:
    return isinstance(model, GPT) and model.config.moe_experts > 0


def check_layout(config: EngineConfig, model: torch.nn.Module, world_size: int,
                 mesh: ParallelMesh | None = None) -> None:
    """Refuse an ep layout or an MoE model's layout that cannot equal one process (no collectives)."""
    par, ep = config.parallel, config.parallel.expert
    moe = _is_moe(model)
    if ep > 1 and not moe:
        raise ConfigError(f"parallel.expert={ep}: expert parallelism splits the experts of an MoE GPT "
                          "(GPTConfig.moe_experts > 0), and this model has none; use parallel.expert 1")
    if not moe:
        return
    problems = []
    if par.context > 1:
        problems.append(f"parallel.context={par.context} with an MoE GPT: each cp rank would route a slice of the "
                        "sequence, and capacity and the aux loss depend on the whole micro-batch's routing; use "
                        "parallel.context 1")
    if par.sequence_parallel:
        problems.append("parallel.sequence_parallel with an MoE GPT: each tp rank would route a slice of the "
                        "sequence (capacity and the aux loss depend on the whole micro-batch's routing); set "
                        "sequence_parallel false")
    ac = config.activation_checkpointing
    if ac.use_reentrant and ac.policy != "none":
        problems.append("activation_checkpointing.use_reentrant=true with an MoE GPT: a re-entrant checkpoint runs "
                        "the block's forward without autograd, so the aux loss (which leaves the block beside its "
                        "output) would not train the router; set use_reentrant false")
    dp = world_size // (par.tensor * par.pipeline * par.context)
    if dp % ep:
        problems.append(f"parallel.expert={ep} must divide the data-parallel size {dp} (= world {world_size} / "
                        f"(tensor x pipeline x context)): the ep groups are runs of ep dp ranks; choose among "
                        f"{[d for d in range(1, dp + 1) if dp % d == 0]}")
    if ep > 1 and config.compression.type == "onebit_adam":
        problems.append(f"compression.type=\"onebit_adam\" with parallel.expert={ep}: 1-bit Adam averages every "
                        "parameter over dp itself, and the expert shards differ between the ranks of an ep group "
                        "(they are averaged over their expert-data-parallel group instead); use parallel.expert 1 "
                        "with onebit_adam, or another compression.type")
    if model.config.moe_experts % ep:
        problems.append(f"parallel.expert={ep} must divide GPTConfig.moe_experts={model.config.moe_experts} (each "
                        f"ep rank computes the same number of experts)")
    if problems:
        raise ConfigError("; ".join(problems))


def apply(model: torch.nn.Module, plan, mesh: ParallelMesh | None) -> None:
    """The MoE layers of this rank's model (its stages) compute their ep share of the experts
    (`plan`: the `LayoutPlan`, engine/plan.py)."""
    ep = plan.ep
    if ep > 1:
        ep_group, edp_group = expert_groups(mesh.layout, ep)
        apply_expert_parallel(model, ep_group)
        shard_experts(model, edp_group, plan.dp)  # E / ep experts stored here, tagged for DDP / ZeRO


def watched(mesh: ParallelMesh | None, plan) -> list:
    """The groups the engine's failure watch adds for ep (engine/step_failure.py): the ep group, whose
    all-to-alls a rank that raised mid-forward or mid-backward would never join."""
    return [expert_groups(mesh.layout, plan.ep)[0]] if plan.ep > 1 else []


# --8<-- [start:placement]
def expert_placement(param, local_global_shape: tuple[int, ...]) -> tuple[int, ...]:
    """An expert shard's global shape: the stacked tensor of every expert (dim 0: E)."""
    return (expert_shard(param).num_experts, *local_global_shape[1:])


def expert_fields(param) -> dict:
    """An expert shard's `Placement` fields: the experts it holds, reduced over edp."""
    return {"ep_range": expert_shard(param).experts, "reduce_over": "edp"}
# --8<-- [end:placement]


# --8<-- [start:pipeline]
def set_aux_grad_scale(model: torch.nn.Module, scale: float | None) -> None:
    """Under a pipeline: every MoE layer backpropagates its aux loss with `scale` (the loss's S / m)."""
    for layer in moe_layers(model):
        layer.aux_grad_scale = scale


def take_aux(model: torch.nn.Module) -> float:
    """The aux losses of the MoE layers that ran a forward since the last call (their values)."""
    total = 0.0
    for layer in moe_layers(model):
        if layer.aux_loss is not None:
            total += float(layer.aux_loss.detach())
            layer.aux_loss = None
    return total
# --8<-- [end:pipeline]
