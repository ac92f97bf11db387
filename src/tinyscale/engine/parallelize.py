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
over the cp axis, gradients reduced over dp x cp), not yet together with tensor parallelism.
Pipeline parallelism is refused by `engine.check_supported` until it lands here.

The mesh is `ParallelMesh(dp=world // (cp tp), cp=cp, tp=tp)`: ranks 0..tp-1 form the first
TP group, and the ranks holding the same TP shard form a dp group. Tests:
`pytest tests/engine/test_engine_tensor_parallel.py` (keys tp, tensor_parallel),
`pytest tests/engine/test_engine_context_parallel.py` (key engine_context_parallel).
"""

from __future__ import annotations

import torch

from tinyscale.checkpointing import apply_policy
from tinyscale.config import ConfigError, EngineConfig
from tinyscale.dist import ParallelMesh
from tinyscale.engine import context
from tinyscale.models.gpt import GPT
from tinyscale.tensor_parallel import apply_tensor_parallel, check_tensor_parallel


def check_config(config: EngineConfig) -> list[str]:
    """What the config alone asks of tensor (and context) parallelism that cannot be served (no model needed)."""
    par, problems = config.parallel, context.check_config(config)
    if par.sequence_parallel and par.tensor == 1:
        problems.append("parallel.sequence_parallel=true needs parallel.tensor > 1 (sequence parallelism splits "
                        "activations over the tensor-parallel group): set parallel.tensor, or sequence_parallel false")
    if par.tensor == 1:
        return problems
    # Each of these is a combination no test covers yet: refused, not silently wrong.
    if config.gradient_clipping > 0 and config.zero_optimization.stage > 0:
        problems.append(f"gradient_clipping={config.gradient_clipping} with parallel.tensor={par.tensor} and "
                        f"zero_optimization.stage={config.zero_optimization.stage} (ZeRO's norm over its dp shards "
                        "does not sum the TP shards yet; stage 0 clips with the full model's norm): "
                        "set gradient_clipping 0 or stage 0")
    for section in ("fp16", "bf16"):
        if getattr(config, section).enabled:
            problems.append(f"{section}.enabled with parallel.tensor={par.tensor} (mixed precision with tensor "
                            "parallelism is not tested yet); use float32/float64 parameters")
    if config.activation_checkpointing.policy != "none":
        problems.append(f"activation_checkpointing.policy={config.activation_checkpointing.policy!r} with "
                        f"parallel.tensor={par.tensor} (not tested yet); use policy \"none\"")
    zero = config.zero_optimization
    if zero.offload_optimizer.device != "none" or zero.offload_param.device != "none":
        problems.append(f"zero_optimization offload with parallel.tensor={par.tensor} (not tested yet); "
                        "use offload device \"none\"")
    return problems


def check_layout(config: EngineConfig, model: torch.nn.Module, world_size: int,
                 mesh: ParallelMesh | None = None) -> None:
    """Refuse a layout this model and world cannot take, naming the field and the fix (no collectives)."""
    context.check_layout(config, model, world_size, mesh)
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
    # apply_tensor_parallel serves these, but the engine does not wire them yet: its dropout seed and
    # mode, checkpoint resharding and clipping norm of replicated K/V heads. Refused, not silently wrong.
    if gpt_config.dropout > 0:
        raise ConfigError(f"parallel.tensor={tp} with GPTConfig.dropout={gpt_config.dropout}: the engine does not "
                          "pass a dropout seed or exact_dropout to apply_tensor_parallel yet; set dropout=0, or "
                          "call tinyscale.tensor_parallel.apply_tensor_parallel yourself")
    if gpt_config.kv_heads < tp:
        raise ConfigError(f"parallel.tensor={tp} with GPTConfig.n_kv_head={gpt_config.kv_heads}: replicated K/V "
                          "heads are not wired into the engine's checkpoints and clipping yet; use n_kv_head a "
                          f"multiple of {tp}, or call tinyscale.tensor_parallel.apply_tensor_parallel yourself")
    if world_size % tp != 0:
        raise ConfigError(f"parallel.tensor={tp} does not divide the world size {world_size}: the ranks are "
                          f"dp x tp; choose parallel.tensor among "
                          f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}")


def build_mesh(config: EngineConfig, world_size: int, mesh: ParallelMesh | None) -> ParallelMesh | None:
    """The caller's mesh, or dp = world / (cp tp) by cp by tp (none in a plain single process)."""
    if mesh is not None or world_size == 1:
        return mesh
    tp, cp = config.parallel.tensor, config.parallel.context
    return ParallelMesh(dp=world_size // (tp * cp), cp=cp, tp=tp)


def parallelize_model(model: torch.nn.Module, config: EngineConfig, mesh: ParallelMesh | None) -> torch.nn.Module:
    """The model-changing steps of the order, in place: tensor / sequence parallel, then
    activation checkpointing (it rebuilds blocks, which the DP/ZeRO hooks then attach to)."""
    if config.parallel.tensor > 1:
        apply_tensor_parallel(model, mesh, sequence_parallel=config.parallel.sequence_parallel)
    context.apply(model, config, mesh)  # ring or Ulysses attention over the cp axis (engine/context.py)
    ac = config.activation_checkpointing
    if ac.policy != "none":
        apply_policy(model, ac.policy, every_k=ac.every_k, use_reentrant=ac.use_reentrant)
    return model
