"""What the engine's pipeline parallelism (`parallel.pipeline`) refuses, before any process group.

The pipeline composes with every other axis: the world is pp x dp x cp x tp (mesh order
(pp, dp, cp, tp), tp fastest), with sequence parallelism when tp > 1, any schedule and
virtual stages, and DDP or ZeRO stages 1-3 over dp (x cp), clipping included.
Config alone (`config_problems`): the schedule's settings without a pipeline; virtual stages
with a schedule that has no chunks; `parallel.pipeline_reshard_after_forward` without ZeRO
stage 3 (it would do nothing), or stage 3 with a persistence threshold (its units are whole
stages); and re-entrant activation checkpointing with zb_h1 (its backward cannot be split
into zero-bubble's B and W passes). fp16/bf16 (`pytest -k layout_mixed_precision`),
activation checkpointing (every policy, every schedule) and offload (tested at ZeRO 1) are
served (`pytest -k "layout_activation_checkpointing or layout_offload"`), and so are
communication_data_type (the dp reduction after the schedule in that dtype) and
wall_clock_breakdown (F actions as forward, B/BW/W as backward, the bubble as waiting:
`pytest tests/engine/test_engine_pipeline_profile.py`). With the model and
world size (`check_layout`): a GPT without stream dropout masks (counter masks,
GPTConfig.dropout_masks="counter", are served), a world that is pp x cp x tp x dp, at least
one block per model stage, and interleaving's micro-batches (``gradient_accumulation_steps``) a
multiple of the stages.
Tests: `pytest tests/engine/test_engine_pipeline.py -k refuse`,
`pytest tests/engine/test_engine_pipeline_compose.py -k refuses`.
"""

from __future__ import annotations

import torch

from tinyscale.config import ConfigError, EngineConfig
from tinyscale.dist import ParallelMesh
from tinyscale.engine.refusals import check_degree


def config_problems(config: EngineConfig) -> list[str]:
    """What the config alone asks of pipeline parallelism that cannot be served (no model needed)."""
    par, problems = config.parallel, []
    pp = par.pipeline
    if pp == 1:
        for name in ("pipeline_schedule", "virtual_stages", "pipeline_reshard_after_forward"):
            if name in par.model_fields_set:  # would silently do nothing
                problems.append(f"parallel.{name}={getattr(par, name)!r} needs parallel.pipeline > 1 (it configures "
                                "the pipeline schedule): set parallel.pipeline, or remove it")
        return problems
    if par.virtual_stages > 1 and par.pipeline_schedule != "interleaved_1f1b":
        problems.append(f"parallel.virtual_stages={par.virtual_stages} with parallel.pipeline_schedule="
                        f"{par.pipeline_schedule!r}: only 'interleaved_1f1b' runs several chunks per rank; set "
                        "pipeline_schedule 'interleaved_1f1b' or virtual_stages 1")
    stage = config.zero_optimization.stage
    threshold = config.zero_optimization.stage3_param_persistence_threshold
    if stage == 3 and threshold > 0:  # stage 3's units are the stages: nothing stays whole
        problems.append(f"zero_optimization.stage3_param_persistence_threshold={threshold} with parallel.pipeline="
                        f"{pp}: under a pipeline stage 3 gathers each stage whole (one unit per stage), so no "
                        "parameter is kept out of it; set it 0")
    if "pipeline_reshard_after_forward" in par.model_fields_set and stage != 3:  # would silently do nothing
        problems.append(f"parallel.pipeline_reshard_after_forward with zero_optimization.stage={stage}: it chooses "
                        "when stage 3 frees a pipeline stage's gathered parameters; set stage 3, or remove it")
    ac = config.activation_checkpointing
    if ac.use_reentrant and ac.policy in ("full", "every_k", "selective") and par.pipeline_schedule == "zb_h1":
        problems.append("activation_checkpointing.use_reentrant=true with parallel.pipeline_schedule='zb_h1': "
                        "zero-bubble's B pass asks autograd for the input gradient alone, and a re-entrant "
                        "checkpoint's backward runs the whole inner backward (parameter gradients too) inside "
                        "it, so it cannot be split into B and W; set use_reentrant false, or another schedule")
    return problems


def check_layout(config: EngineConfig, model: torch.nn.Module, world_size: int,
                 mesh: ParallelMesh | None = None) -> None:
    """Refuse a pipeline this model and world cannot take, naming the field and the fix (no collectives)."""
    par = config.parallel
    pp, v, tp = par.pipeline, par.virtual_stages, par.tensor
    if not check_degree(model, mesh, axis="pp", field="parallel.pipeline", degree=pp,
                        action="pipeline parallelism cuts tinyscale's GPT into stages"):
        return
    cp = par.context
    if world_size % (pp * cp * tp):
        raise ConfigError(f"parallel.pipeline={pp} x parallel.context={cp} x parallel.tensor={tp} does not divide "
                          f"the world size {world_size}: the ranks are pp x dp x cp x tp; choose parallel.pipeline "
                          f"among {[d for d in range(1, world_size + 1) if world_size % (d * cp * tp) == 0]}")
    if model.config.dropout > 0 and model.config.dropout_masks == "stream":
        raise ConfigError(f"parallel.pipeline={pp} with GPTConfig.dropout={model.config.dropout} and dropout_masks="
                          "'stream': each stage draws from its own process's generator, in the schedule's order, "
                          "never one process's sequence of draws; set GPTConfig.dropout_masks='counter' (masks "
                          "hashed from global coordinates), or dropout=0")
    n_layer = model.config.n_layer
    if pp * v > n_layer:
        raise ConfigError(f"parallel.pipeline={pp} x parallel.virtual_stages={v} = {pp * v} model stages but the "
                          f"GPT has n_layer={n_layer} blocks (every stage needs one): lower parallel.pipeline or "
                          "parallel.virtual_stages, or use a deeper model")
    m = config.batch(world_size // (pp * cp * tp)).gradient_accumulation_steps  # the micro-batches per step
    if par.pipeline_schedule == "interleaved_1f1b" and m % pp:
        raise ConfigError(f"parallel.pipeline_schedule 'interleaved_1f1b' walks micro-batches in rounds of "
                          f"parallel.pipeline={pp}, but gradient_accumulation_steps={m} (the micro-batches per "
                          f"step) is not a multiple of it: use {(m // pp + 1) * pp}, or another schedule")
