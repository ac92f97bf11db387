"""Layouts composed in one place, in one order (DESIGN.md, "Composing layouts").

    pipeline partition -> tensor / sequence parallel -> context parallel
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
without sequence parallelism).
Pipeline parallelism (`engine/pipeline_step.py`, `partition_pipeline`: the model keeps this
rank's stages) with DDP or ZeRO stage 1 over dp, and with tensor parallelism (pp x tp at dp 1,
without sequence parallelism: this rank's stages split over tp, `engine/pipeline_tp.py`); not
yet with context parallelism. fp16 (loss scaling) and bf16 in each of these layouts: fp32
masters of this rank's pieces (TP shards, stages), the overflow flag agreed over the whole
world, and at ZeRO stage 0 the masters clipped by the whole model's norm
(`mixed_precision_clipper`; ZeRO's shards: `engine/tp_grad_norm.py`). Tests:
`pytest -k layout_mixed_precision`.

The mesh is `ParallelMesh(dp=world // (cp tp), cp=cp, tp=tp)`: ranks 0..tp-1 form the first
TP group, and the ranks holding the same TP shard form a dp group. Tests:
`pytest tests/engine/test_engine_tensor_parallel.py` (keys tp, tensor_parallel),
`pytest tests/engine/test_engine_context_parallel.py` (key engine_context_parallel).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from tinyscale.checkpointing import apply_policy
from tinyscale.config import ConfigError, EngineConfig
from tinyscale.dist import ParallelMesh, comm
from tinyscale.engine import context, pipeline_layout
from tinyscale.engine.refusals import untested_combinations
from tinyscale.engine.pipeline_step import PipelineStep, clip_grad_norm_pp
from tinyscale.engine.tp_grad_norm import clip_grad_norm_tp, counted_parameters
from tinyscale.models.gpt import GPT
from tinyscale.tensor_parallel import apply_tensor_parallel, check_tensor_parallel
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
    if par.tensor == 1:
        return problems
    # Each of these is a combination no test covers yet: refused, not silently wrong. Offload is
    # served: ZeRO keeps each TP shard's states on the host like any parameter's (-k acceptance).
    untested = untested_combinations(config, f"parallel.tensor={par.tensor}", "tensor parallelism")
    return problems + [p for p in untested if not p.startswith("zero_optimization offload")]


def check_layout(config: EngineConfig, model: torch.nn.Module, world_size: int,
                 mesh: ParallelMesh | None = None) -> None:
    """Refuse a layout this model and world cannot take, naming the field and the fix (no collectives)."""
    context.check_layout(config, model, world_size, mesh)
    pipeline_layout.check_layout(config, model, world_size, mesh)
    tp = config.parallel.tensor
    if mesh is not None and mesh.size("tp") != tp:
        raise ConfigError(f"parallel.tensor={tp} but the mesh passed to initialize has tp={mesh.size('tp')}: "
                          f"make them equal (or pass no mesh: the engine builds dp={world_size // tp}, tp={tp})")
    if tp == 1:
        return
    if not isinstance(model, GPT):
        raise ConfigError(f"parallel.tensor={tp}: tensor parallelism splits tinyscale's GPT, not a "
                          f"{type(model).__name__}; use parallel.tensor 1 for this model")
    check_gpt_split(model.config, tp, world_size)


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


def build_mesh(config: EngineConfig, world_size: int, mesh: ParallelMesh | None) -> ParallelMesh | None:
    """The caller's mesh, or dp = world / (cp tp) by cp by tp (none in a plain single process)."""
    if mesh is not None or world_size == 1:
        return mesh
    tp, cp, pp = config.parallel.tensor, config.parallel.context, config.parallel.pipeline
    return ParallelMesh(dp=world_size // (tp * cp * pp), cp=cp, tp=tp, pp=pp)


def partition_pipeline(model: torch.nn.Module, config: EngineConfig,
                       mesh: ParallelMesh | None) -> PipelineStep | None:
    """First in the order: cut the GPT into pipeline stages and keep this rank's, in place
    (`engine/pipeline_step.py`); None without parallel.pipeline."""
    return PipelineStep(model, config, mesh) if config.parallel.pipeline > 1 else None


def parallelize_model(model: torch.nn.Module, config: EngineConfig, mesh: ParallelMesh | None,
                      pipeline: PipelineStep | None = None) -> torch.nn.Module:
    """The model-changing steps of the order, in place: tensor / sequence parallel, then
    activation checkpointing (it rebuilds blocks, which the DP/ZeRO hooks then attach to).
    After `partition_pipeline` (`pipeline`), tensor parallelism splits this rank's stages."""
    par = config.parallel
    if par.tensor > 1 and pipeline is not None:  # pp x tp (engine/pipeline_tp.py); no dropout with pp
        pipeline.split_tensor_parallel(model, mesh)
    elif par.tensor > 1:
        exact, seed = par.tensor_dropout == "exact", 0
        if model.config.dropout > 0:  # the shared stream equal where the masks must agree (random.py)
            group, src = (None, 0) if exact else (mesh.group("tp"), mesh.group_ranks("tp")[0])
            seed = share_stream(group, src, next(model.parameters()).device)
        apply_tensor_parallel(model, mesh, sequence_parallel=par.sequence_parallel, exact_dropout=exact,
                              dropout_seed=seed)
    context.apply(model, config, mesh)  # ring or Ulysses attention over the cp axis (engine/context.py)
    ac = config.activation_checkpointing
    if ac.policy != "none":
        apply_policy(model, ac.policy, every_k=ac.every_k, use_reentrant=ac.use_reentrant)
    return model


# --8<-- [start:mixed-precision-clip]
def mixed_precision_clipper(mp, model: torch.nn.Module, config: EngineConfig,
                            pipeline: PipelineStep | None) -> Callable[[float], float] | None:
    """Mixed precision at ZeRO stage 0: a `clip_grad_norm_` for the `MixedPrecisionOptimizer`
    `mp` when this rank holds a piece of the model. Its fp32 masters' unscaled gradients are
    clipped by the whole model's norm, each master counted as its parameter is: over the pp
    group and the TP group with a pipeline (`clip_grad_norm_pp`), over the TP group without
    (`engine/tp_grad_norm.py`). None where torch's local norm is already the whole model's
    (dp and cp: every rank holds the whole model's reduced gradients). ZeRO clips its shards
    itself (`sharded_clipper`)."""
    master = {id(p): m for p, m in zip(mp.params, mp.masters)}
    if pipeline is not None:
        counted = [master[id(q)] for q in pipeline.counted if id(q) in master]
        return lambda max_norm: float(clip_grad_norm_pp(mp.masters, counted, max_norm, pipeline.group,
                                                        tp_group=pipeline.tp_group))
    if config.parallel.tensor > 1:
        ids = {id(master[i]) for i in counted_parameters(model, model.tp_group) if i in master}
        return lambda max_norm: float(clip_grad_norm_tp(mp.masters, ids, max_norm, model.tp_group))
    return None
# --8<-- [end:mixed-precision-clip]


# --8<-- [start:dropout]
def skip_dropout_masks(model: torch.nn.Module, config: EngineConfig, micro: list, forwards: int) -> None:
    """Exact dropout over dp ranks: draw (and drop) the masks of `forwards` micro-batches of the
    others, as one process draws the global batch's micro-batches in order (dp rank r's come after
    r * len(micro) others'). Nothing to do without tensor parallelism's exact mode."""
    if not (forwards and micro and config.parallel.tensor > 1 and config.parallel.tensor_dropout == "exact"
            and model.config.dropout > 0):
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


def failed_ranks(failed_here: bool, device: torch.device) -> list[int]:
    """The global ranks whose forward or backward raised this step, agreed over the whole world
    (one all-reduce of a flag per rank): under tensor parallelism a rank's failure must stop its
    TP peers as well as its dp peers, or the TP shards of one model would step apart."""
    flags = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    flags[dist.get_rank()] = float(failed_here)
    comm.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]
