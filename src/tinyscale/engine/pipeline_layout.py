"""What the engine's pipeline parallelism (`parallel.pipeline`) refuses, before any process group.

Config alone (`config_problems`): the schedule's settings without a pipeline; virtual stages
with a schedule that has no chunks; the combinations no test covers yet (context or sequence
parallelism; tensor parallelism is served, `engine/pipeline_tp.py`, and fp16/bf16 are,
`-k layout_mixed_precision`; ZeRO stages 2 and 3, clipping under ZeRO 1, activation
checkpointing, offload, communication_data_type, wall_clock_breakdown). With the model and
world size (`check_layout`): a GPT without dropout, a world that is pp x tp x dp (dp 1 when
tp > 1: not tested yet), at least one block per model stage, and interleaving's micro-batches
(``gradient_accumulation_steps``) a multiple of the stages.
Tests: `pytest tests/engine/test_engine_pipeline.py -k refuse`.
"""

from __future__ import annotations

import torch

from tinyscale.config import ConfigError, EngineConfig
from tinyscale.dist import ParallelMesh
from tinyscale.engine.refusals import check_degree, untested_combinations


def config_problems(config: EngineConfig) -> list[str]:
    """What the config alone asks of pipeline parallelism that cannot be served (no model needed)."""
    par, problems = config.parallel, []
    pp = par.pipeline
    if pp == 1:
        for name in ("pipeline_schedule", "virtual_stages"):
            if name in par.model_fields_set:  # would silently do nothing
                problems.append(f"parallel.{name}={getattr(par, name)!r} needs parallel.pipeline > 1 (it configures "
                                "the pipeline schedule): set parallel.pipeline, or remove it")
        return problems
    if par.virtual_stages > 1 and par.pipeline_schedule != "interleaved_1f1b":
        problems.append(f"parallel.virtual_stages={par.virtual_stages} with parallel.pipeline_schedule="
                        f"{par.pipeline_schedule!r}: only 'interleaved_1f1b' runs several chunks per rank; set "
                        "pipeline_schedule 'interleaved_1f1b' or virtual_stages 1")
    stage = config.zero_optimization.stage
    if stage >= 2:
        problems.append(f"zero_optimization.stage={stage} with parallel.pipeline={pp}: stage 2 reduce-scatters the "
                        "gradients in every micro-batch's backward and stage 3 gathers the parameters for every "
                        "micro-batch, which does not fit a schedule interleaving many micro-batches' passes "
                        "(DeepSpeed refuses it too); use stage 0 or 1")
    # Combinations no test covers yet: refused, not silently wrong.
    if par.context > 1:
        problems.append(f"parallel.context={par.context} with parallel.pipeline={pp} (not composed yet): set "
                        "parallel.context to 1")
    if par.sequence_parallel:  # tensor parallelism with a pipeline is served, sequence parallelism not yet
        problems.append(f"parallel.sequence_parallel=true with parallel.pipeline={pp} (stages would pass "
                        "(B, T/t, C) shards; not tested yet): set sequence_parallel false")
    if config.gradient_clipping > 0 and stage == 1:
        problems.append(f"gradient_clipping={config.gradient_clipping} with parallel.pipeline={pp} and "
                        "zero_optimization.stage=1 (ZeRO's norm does not sum over the stages yet; stage 0 clips "
                        "with the full model's norm): set gradient_clipping 0 or stage 0")
    problems += untested_combinations(config, f"parallel.pipeline={pp}", "pipeline parallelism")
    if config.communication_data_type is not None:
        problems.append(f"communication_data_type={config.communication_data_type!r} with parallel.pipeline={pp} "
                        "(not tested yet); remove it")
    if config.wall_clock_breakdown:
        problems.append(f"wall_clock_breakdown with parallel.pipeline={pp}: a schedule interleaves forwards and "
                        "backwards, which the per-phase profile does not split yet; set it false")
    return problems


def check_layout(config: EngineConfig, model: torch.nn.Module, world_size: int,
                 mesh: ParallelMesh | None = None) -> None:
    """Refuse a pipeline this model and world cannot take, naming the field and the fix (no collectives)."""
    par = config.parallel
    pp, v, tp = par.pipeline, par.virtual_stages, par.tensor
    if not check_degree(model, mesh, axis="pp", field="parallel.pipeline", degree=pp,
                        action="pipeline parallelism cuts tinyscale's GPT into stages"):
        return
    if world_size % (pp * tp):
        raise ConfigError(f"parallel.pipeline={pp} x parallel.tensor={tp} does not divide the world size "
                          f"{world_size}: the ranks are pp x dp x tp; choose parallel.pipeline among "
                          f"{[d for d in range(1, world_size + 1) if world_size % (d * tp) == 0]}")
    if tp > 1 and world_size > pp * tp:  # pp x tp is tested at dp 1 only (world 4; dp 2 would need 8 ranks)
        raise ConfigError(f"parallel.pipeline={pp} x parallel.tensor={tp} on {world_size} ranks gives dp="
                          f"{world_size // (pp * tp)}: data parallelism with pp x tp is not tested yet; use "
                          f"{pp * tp} ranks (dp 1), or parallel.tensor 1 for dp x pp")
    if model.config.dropout > 0:
        raise ConfigError(f"parallel.pipeline={pp} with GPTConfig.dropout={model.config.dropout}: each stage draws "
                          "its masks from its own generator, which no test compares with one process yet; set "
                          "dropout=0 or parallel.pipeline 1")
    n_layer = model.config.n_layer
    if pp * v > n_layer:
        raise ConfigError(f"parallel.pipeline={pp} x parallel.virtual_stages={v} = {pp * v} model stages but the "
                          f"GPT has n_layer={n_layer} blocks (every stage needs one): lower parallel.pipeline or "
                          "parallel.virtual_stages, or use a deeper model")
    m = config.batch(world_size // (pp * tp)).gradient_accumulation_steps  # the micro-batches per step
    if par.pipeline_schedule == "interleaved_1f1b" and m % pp:
        raise ConfigError(f"parallel.pipeline_schedule 'interleaved_1f1b' walks micro-batches in rounds of "
                          f"parallel.pipeline={pp}, but gradient_accumulation_steps={m} (the micro-batches per "
                          f"step) is not a multiple of it: use {(m // pp + 1) * pp}, or another schedule")
