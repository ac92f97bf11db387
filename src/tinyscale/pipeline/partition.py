"""Cut the GPT into pipeline stages: which blocks, and whether the embedding or the head, go where.

The GPT (`tinyscale.models.gpt`) is embed -> blocks[0..L-1] -> norm -> head -> loss. Stage 0
takes the embedding, the last stage the final norm, the head and the loss; the L blocks are
cut into p*v contiguous, non-empty runs, one per model stage (p pipeline ranks, v chunks per
rank for interleaving; stage s on rank s % p as its chunk s // p, as in `schedules.py`).

Balance: the cut minimises the most expensive stage (a pipeline runs at its slowest stage's
pace), then, among the cuts with that maximum, the sum of squared stage costs (as even as
possible); remaining ties give later stages the extra layers, because in 1F1B stage 0 holds
the most activations. Costs are parameter counts by default (memory balance; the embedding
and head tables count on the stages holding them, a tied table on both, since each holds a
copy), or measured per-block times (`layer_costs`, with `embedding_cost` and `head_cost`).
Layer counts that the stages do not divide are fine; more stages than blocks is not.

Pure: this says where layers go; moving modules is the executor's job.
Tests: `pytest tests/pipeline -k pp_partition`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tinyscale.models.config import GPTConfig


@dataclasses.dataclass(frozen=True)
class StageLayers:
    """What model stage `stage` holds: blocks `layers` (indices into GPT.blocks), plus the
    embedding on stage 0 and the final norm + head + loss on the last stage."""

    stage: int
    rank: int
    chunk: int
    layers: tuple[int, ...]
    embedding: bool
    head: bool
    cost: float


def gpt_param_costs(config: GPTConfig) -> tuple[int, list[int], int]:
    """Parameter counts (embedding, each block, final norm + head) from the shapes alone.
    A tied head counts its table again: the last stage holds its own copy."""
    C, V = config.d_model, config.vocab_size
    attn = 2 * C * C + 2 * C * config.kv_dim  # wq, wo: C x C; wk, wv: C x K*D
    mlp = 3 * C * config.ffn_dim  # w_gate, w_up: C x F; w_down: F x C
    block = attn + mlp + 2 * C + config.attn_bias_params + config.mlp_bias_params  # + RMSNorms, biases
    return V * C, [block] * config.n_layer, C + V * C


def balanced_split(costs: Sequence[float], num_parts: int, *, first_extra: float = 0,
                   last_extra: float = 0) -> list[range]:
    """Cut `costs` into `num_parts` contiguous non-empty runs minimising the largest run's cost
    (the first run also pays `first_extra`, the last `last_extra`), then the sum of squares."""
    n = len(costs)
    if not 1 <= num_parts <= n:
        raise ValueError(f"cannot cut {n} layers into {num_parts} non-empty stages: "
                         f"use between 1 and {n} stages")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def run_cost(part: int, start: int, end: int) -> float:  # layers start..end-1 as part `part`
        extra = (first_extra if part == 0 else 0) + (last_extra if part == num_parts - 1 else 0)
        return prefix[end] - prefix[start] + extra

    def best(score) -> tuple[float, list[list[int]]]:
        """DP over (parts, layers): value[j][i] = best score cutting layers 0..i-1 into j runs,
        `score(old, part, start, end)` combining the first j-1 runs' value with run j."""
        inf = float("inf")
        value = [[inf] * (n + 1) for _ in range(num_parts + 1)]
        cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
        value[0][0] = 0
        for j in range(1, num_parts + 1):
            for i in range(j, n + 1):
                for start in range(j - 1, i):  # run j-1 covers start..i-1; smallest start wins ties
                    if value[j - 1][start] < inf:
                        v = score(value[j - 1][start], j - 1, start, i)
                        if v < value[j][i]:
                            value[j][i], cut[j][i] = v, start
        return value[num_parts][n], cut

    bottleneck, _ = best(lambda old, part, s, e: max(old, run_cost(part, s, e)))
    _, cut = best(lambda old, part, s, e: old + run_cost(part, s, e) ** 2
                  if run_cost(part, s, e) <= bottleneck else float("inf"))
    runs, end = [], n
    for j in range(num_parts, 0, -1):
        start = cut[j][end]
        runs.append(range(start, end))
        end = start
    return runs[::-1]


def partition_gpt(config: GPTConfig, num_stages: int, *, virtual_stages: int = 1,
                  layer_costs: Sequence[float] | None = None, embedding_cost: float = 0,
                  head_cost: float = 0) -> list[StageLayers]:
    """The p*v model stages of `config`'s GPT, in stage order.

    Without `layer_costs`, balances parameter counts (`gpt_param_costs`); with them (one per
    block, e.g. measured seconds), balances those plus `embedding_cost` on stage 0 and
    `head_cost` (norm + head + loss) on the last stage, in the same units."""
    for name, value in (("num_stages", num_stages), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    total = num_stages * virtual_stages
    if total > config.n_layer:
        raise ValueError(f"num_stages={num_stages} x virtual_stages={virtual_stages} = {total} stages "
                         f"but the GPT has n_layer={config.n_layer} blocks: every stage needs at least "
                         "one block; use fewer stages or chunks, or a deeper model")
    if layer_costs is None:
        embedding_cost, costs, head_cost = gpt_param_costs(config)
    else:
        costs = list(layer_costs)
        if len(costs) != config.n_layer or any(not c >= 0 for c in costs):
            raise ValueError(f"layer_costs has {len(costs)} entries {costs}: give one cost >= 0 "
                             f"per block, n_layer={config.n_layer}")
    runs = balanced_split(costs, total, first_extra=embedding_cost, last_extra=head_cost)
    return [StageLayers(stage=s, rank=s % num_stages, chunk=s // num_stages, layers=tuple(run),
                        embedding=s == 0, head=s == total - 1,
                        cost=sum(costs[i] for i in run) + embedding_cost * (s == 0) + head_cost * (s == total - 1))
            for s, run in enumerate(runs)]


def stages_on_rank(plan: list[StageLayers], rank: int) -> list[StageLayers]:
    """The stages `rank` holds, chunk 0 first."""
    return sorted((st for st in plan if st.rank == rank), key=lambda st: st.chunk)
