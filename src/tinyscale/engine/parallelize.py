# --8<-- [start:order]
"""Layouts composed in one place, in one order (DESIGN.md, "Composing layouts").

    pipeline partition -> tensor / sequence parallel -> context parallel -> expert parallel
        -> activation checkpointing -> mixed precision -> data parallel or ZeRO over the dp axis

Why this order: each transform changes the model the next one sees. Tensor parallelism
replaces the GPT's linear layers and embedding by their shards, so everything after it
(checkpointed blocks, fp32 masters, DDP buckets, ZeRO shards) is built from this rank's TP
shards; ZeRO then shards those over the dp axis only (torchtitan's FSDP + TP 2D layout).
The optimizer must be built after every transform that replaces parameters and before
mixed precision rounds them (its fp32 masters are taken first), so the last two steps are
built by `Engine.__init__`, which calls `parallelize_model` first and then builds them over
`mesh.group("dp", "cp")` (the dp axis; with context parallelism, dp x cp flattened).

Everything a layout can refuse is refused here before any process group is created
(`check_layout`, `ConfigError` naming the field and the fix). Built so far: tensor and
sequence parallelism (`tinyscale.tensor_parallel`) for the GPT, with data parallelism and
ZeRO stages 1-3 over the dp axis; context parallelism (`engine/context.py`: ring or Ulysses
over the cp axis, gradients reduced over dp x cp), also with tensor parallelism (tp x cp,
without sequence parallelism). A model tinyscale did not write (a transformers Llama or Qwen2)
is split by AutoTP (`tinyscale.tensor_parallel.auto`: its Linear and Embedding layers found by
name, `parallel.tp_plan` first; every layer it cannot place refused by name), with data
parallelism and ZeRO 0-3 over dp; not with sequence, context or pipeline parallelism, which
rewrite the GPT's own forward.
Pipeline parallelism (`engine/pipeline_step.py`, `partition_pipeline`: the model keeps this
rank's stages) composes with every other axis, at the same places in the order: tensor and
sequence parallelism split this rank's stages (`engine/pipeline_tp.py`), context parallelism
swaps their attention (`context.apply_to_stages`), and DDP or ZeRO stages 1-3 run over dp
(x cp), reducing once after the schedule (stage 3's units are this rank's stages).
Expert parallelism (`engine/expert.py`, an MoE GPT's experts split over ep groups inside dp, tokens
by all-to-all) comes after them: it sets which experts the MoE layers of this rank's (TP-split)
stages compute. Activation checkpointing (every policy of `tinyscale.checkpointing`) composes with all of them: it
comes after the layers are split, changes each block's class in place over the tensor-parallel one
(a pipeline stage's blocks are the same objects), and a recomputation replays the TP RNG tracker's
stream as well as torch's, so the masks are the forward's; under ZeRO-3 the rerun runs inside the
block's backward, whose hooks have gathered its parameters. ZeRO offload (cpu, nvme) belongs to
the optimizer over dp (x cp) and composes with every layout ZeRO does. Tests:
`pytest -k "layout_activation_checkpointing or layout_offload"` (bit-identical to the same layout
without them).
torch.compile of the blocks (`compile.enabled`, `engine/compiled.py`) is the last change to the model,
after checkpointing: it compiles each block's forward as the transforms left it (`pytest -k torch_compile`).

The mesh is `ParallelMesh(dp=world // (pp cp tp), cp=cp, tp=tp, pp=pp)`, dims (pp, dp, cp, tp):
ranks 0..tp-1 form the first TP group, and the ranks holding the same TP shard form a dp group. Tests:
`pytest tests/engine/test_engine_tensor_parallel.py` (keys tp, tensor_parallel),
`pytest tests/engine/test_engine_context_parallel.py` (key engine_context_parallel).
"""
# --8<-- [end:order]

from __future__ import annotations


import torch

from tinyscale.checkpointing import apply_policy
from tinyscale.config import ConfigError, EngineConfig
from tinyscale.dist import ParallelMesh
from tinyscale.engine import compiled, context, expert, pipeline_layout
from tinyscale.engine.pipeline_step import PipelineStep
from tinyscale.engine.plan import LayoutPlan
from tinyscale.models.gpt import GPT
from tinyscale.tensor_parallel import apply_tensor_parallel, check_tensor_parallel
from tinyscale.tensor_parallel.auto import apply_autotp, find_plan
from tinyscale.tensor_parallel.random import share_stream, skip_exact_masks


def check_config(config: EngineConfig) -> list[str]:
    """What the config alone asks of tensor (and context) parallelism that cannot be served (no model needed)."""
    par, problems = config.parallel, context.check_config(config) + pipeline_layout.config_problems(config)
    if par.sequence_parallel and par.tensor == 1:
        problems.append("parallel.sequence_parallel=true needs parallel.tensor > 1 (sequence parallelism splits "
                        "activations over the tensor-parallel group): set parallel.tensor, or sequence_parallel false")
    if "tensor_dropout" in par.model_fields_set and par.tensor == 1:
        problems.append(f"parallel.tensor_dropout={par.tensor_dropout!r} needs parallel.tensor > 1 (it chooses how "
                        "tensor-parallel ranks draw dropout masks): set parallel.tensor, or remove tensor_dropout")
    if par.tp_plan and par.tensor == 1:
        problems.append("parallel.tp_plan needs parallel.tensor > 1 (it places layers over the tensor-parallel "
                        "group): set parallel.tensor, or remove tp_plan")
    if config.activation_checkpointing.partition_activations and (par.tensor == 1 or par.sequence_parallel):
        problems.append("activation_checkpointing.partition_activations splits each checkpointed block's input, "
                        "equal on every rank of the tensor-parallel group, over that group: it needs parallel.tensor "
                        "> 1 without sequence_parallel (whose block inputs are each rank's own sequence shard "
                        "already: the same saving, no gather); set it false")
    return problems


def check_layout(config: EngineConfig, model: torch.nn.Module, world_size: int,
                 mesh: ParallelMesh | None = None) -> None:
    """Refuse a layout this model and world cannot take, naming the field and the fix (no collectives)."""
    context.check_layout(config, model, world_size, mesh)
    pipeline_layout.check_layout(config, model, world_size, mesh)
    check_tensor_layout(config, model, world_size, mesh)


def check_tensor_layout(config: EngineConfig, model: torch.nn.Module, world_size: int,
                        mesh: ParallelMesh | None = None) -> dict[str, str] | None:
    """Tensor parallelism's part of `check_layout` (`engine/plan.py` runs each part and lists them all);
    returns AutoTP's plan for a model tinyscale did not write (`LayoutPlan.autotp`), else None."""
    tp = config.parallel.tensor
    if mesh is not None and mesh.size("tp") != tp:
        raise ConfigError(f"parallel.tensor={tp} but the mesh passed to initialize has tp={mesh.size('tp')}: "
                          f"make them equal (or pass no mesh: the engine builds dp={world_size // tp}, tp={tp})")
    if tp == 1:
        return None
    if not isinstance(model, GPT):  # AutoTP: found in the module tree, or refused by name
        return check_autotp(config, model, tp, world_size)
    if config.parallel.tp_plan:
        raise ConfigError("parallel.tp_plan places the layers of a model tinyscale did not write (AutoTP); "
                          "tinyscale's GPT is split by its own plan (tensor_parallel/apply.py): remove tp_plan")
    check_gpt_split(model.config, tp, world_size)
    if "tensor_dropout" in config.parallel.model_fields_set and model.config.dropout_masks == "counter":
        raise ConfigError(f"parallel.tensor_dropout={config.parallel.tensor_dropout!r} with GPTConfig.dropout_masks="
                          "'counter': tensor_dropout chooses how TP ranks draw stream masks, and counter masks are "
                          "hashed from global coordinates, the same on every rank; remove tensor_dropout")
    return None


def check_autotp(config: EngineConfig, model: torch.nn.Module, tp: int, world_size: int) -> dict[str, str]:
    """AutoTP's part of `check_tensor_layout`: the plan is found (pure), and what it cannot serve
    refused; returns the plan, which `parallelize_model` applies as found (it is not searched twice)."""
    problems, plan = [], {}
    if config.parallel.sequence_parallel:
        problems.append(f"parallel.sequence_parallel with a {type(model).__name__}: sequence parallelism runs "
                        "norms and residuals on sequence shards inside tinyscale's GPT's forward, and AutoTP "
                        "keeps the model's own forward; set sequence_parallel false")
    if "tensor_dropout" in config.parallel.model_fields_set:
        problems.append(f"parallel.tensor_dropout with a {type(model).__name__}: it chooses how tinyscale's GPT "
                        "draws dropout masks, and AutoTP refuses dropout; remove tensor_dropout")
    try:
        plan = find_plan(model, tp, config.parallel.tp_plan)
    except ValueError as exc:
        problems.append(f"parallel.tensor={tp}: {exc}")
    if world_size % tp != 0:
        problems.append(f"parallel.tensor={tp} does not divide the world size {world_size}")
    if problems:
        raise ConfigError("\n".join(problems))
    return plan


def check_gpt_split(gpt_config, tp: int, world_size: int) -> None:
    """The GPT with `gpt_config` splits over tp ranks, and tp divides the world (pure arithmetic)."""
    try:
        check_tensor_parallel(gpt_config, tp)
    except ValueError as exc:
        raise ConfigError(f"parallel.tensor={tp}: {exc}") from None
    if world_size % tp != 0:
        raise ConfigError(f"parallel.tensor={tp} does not divide the world size {world_size}: the ranks are "
                          f"dp x tp; choose parallel.tensor among "
                          f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}")


def build_mesh(plan: LayoutPlan, mesh: ParallelMesh | None) -> ParallelMesh | None:
    """The caller's mesh, or the plan's pp x dp x cp x tp (none in a plain single process)."""
    if mesh is not None or plan.world_size == 1:
        return mesh
    return ParallelMesh(dp=plan.dp, cp=plan.cp, tp=plan.tp, pp=plan.pp)


def partition_pipeline(model: torch.nn.Module, plan: LayoutPlan, mesh: ParallelMesh | None,
                       micro_batches: int) -> PipelineStep | None:
    """First in the order: cut the GPT into pipeline stages and keep this rank's, in place
    (`engine/pipeline_step.py`), its schedule lowered for `micro_batches` per step; None without
    a pipeline."""
    return PipelineStep(model, plan, mesh, micro_batches) if plan.pp > 1 else None


def parallelize_model(model: torch.nn.Module, plan: LayoutPlan, mesh: ParallelMesh | None,
                      pipeline: PipelineStep | None = None) -> torch.nn.Module:
    """The model-changing steps of the order, in place: tensor / sequence parallel, then
    activation checkpointing (it rebuilds blocks, which the DP/ZeRO hooks then attach to).
    After `partition_pipeline` (`pipeline`), tensor parallelism splits this rank's stages.
    Everything is read from `plan` (`engine/plan.py`), none of it from the config."""
    if plan.tp > 1 and not isinstance(model, GPT):  # AutoTP: the plan plan_layout's check found
        apply_autotp(model, mesh.group("tp"), dict(plan.autotp))
    elif plan.tp > 1 and pipeline is not None:  # pp x tp (engine/pipeline_tp.py); counter dropout only
        pipeline.split_tensor_parallel(model, mesh, sequence_parallel=plan.sequence_parallel)
    elif plan.tp > 1:
        exact, seed = plan.tensor_dropout == "exact", 0
        # Stream masks: the shared stream equal where the masks must agree (random.py); counter masks need none.
        if model.config.dropout > 0 and model.config.dropout_masks == "stream":
            group, src = (None, 0) if exact else (mesh.group("tp"), mesh.group_ranks("tp")[0])
            seed = share_stream(group, src, next(model.parameters()).device)
        apply_tensor_parallel(model, mesh, sequence_parallel=plan.sequence_parallel, exact_dropout=exact,
                              dropout_seed=seed)
    if plan.cp > 1 and pipeline is not None:  # pp x cp: this rank's stages on their sequence shard
        pipeline.split_context_parallel(model, plan, mesh)
    else:
        context.apply(model, plan, mesh)  # ring or Ulysses attention over the cp axis (engine/context.py)
    expert.apply(model, plan, mesh)  # an MoE GPT's experts split over the ep groups inside dp (engine/expert.py)
    # --8<-- [start:activation-checkpointing]
    ac = plan.checkpointing
    if ac.policy != "none":  # a recomputation replays the TP tracker's stream too (tensor_parallel/random.py)
        tracker = getattr(model, "rng_tracker", None)
        apply_policy(model, ac.policy, every_k=ac.every_k, use_reentrant=ac.use_reentrant,
                     generators=[tracker.generator] if tracker is not None else [],
                     partition_group=mesh.group("tp") if ac.partition_activations else None,
                     inputs_to_host=ac.cpu_checkpointing)
    # --8<-- [end:activation-checkpointing]
    return compiled.compile_blocks(model, plan.compile)  # last: torch.compile of each block (engine/compiled.py)


# --8<-- [start:dropout]
def skip_dropout_masks(model: torch.nn.Module, plan: LayoutPlan, micro: list, forwards: int) -> None:
    """Exact dropout over dp ranks: draw (and drop) the masks of `forwards` micro-batches of the
    others, as one process draws the global batch's micro-batches in order (dp rank r's come after
    r * len(micro) others'). Nothing to do without tensor parallelism's exact mode."""
    if not (forwards and micro and plan.tp > 1 and plan.tensor_dropout == "exact"
            and isinstance(model, GPT) and model.config.dropout > 0 and model.config.dropout_masks == "stream"):
        return
    rows, seq_len = micro[0][0].shape  # every dp rank's micro-batches have this shape
    skip_exact_masks(model, rows, seq_len, forwards * len(micro))
# --8<-- [end:dropout]


def rng_state(model: torch.nn.Module) -> dict:
    """The tracker's stream, for the checkpoint's and a dropped step's random state (none without TP)."""
    tracker = getattr(model, "rng_tracker", None)
    return {} if tracker is None else {"tp_tracker": tracker.get_state()}


def restore_rng(model: torch.nn.Module, state: dict | None) -> None:
    tracker = getattr(model, "rng_tracker", None)
    if tracker is not None and state and "tp_tracker" in state:
        tracker.set_state(state["tp_tracker"])

