"""Model-state bytes per rank in any layout, exactly: pure arithmetic on the GPT's shapes and the plan.

    tensors = rank_tensors(gpt_config, plan, rank)   # the parameters `rank` holds, in the engine's order
    counts = rank_param_counts(gpt_config, plan)     # {rank: elements of those tensors}
    states = rank_model_state_bytes(gpt_config, plan, dtype_bytes=8)   # {rank: {category: bytes}}

`plan` is a `LayoutPlan` (`engine/plan.py`: dp, pp, cp, tp, virtual stages, ZeRO stage), built
by hand or by `plan_layout`; no process, no torch. `rank_model_state_bytes` equals
`engine.memory_report(when="before_step")`'s parameters, gradients, master_weights and
optimizer_states (summed over device, host and disk) on every rank, byte for byte
(`pytest tests/engine/test_layout_memory.py`, key layout_memory, in every layout of the layout
matrix). `zero.estimate.model_state_bytes` is the ideal (Psi / N_d, no padding); this is what
the engine holds. The rules, each read off the code that makes it true:

Pipeline (`pipeline.partition.partition_gpt`, `pipeline.apply`): model stage s runs on pipeline
rank s % pp; stage 0 holds the embedding, the last stage the final norm and the head. A rank
keeps its stages' parameters in the model's order (embedding, its blocks by index, norm, head).
A tied table is one tensor without a pipeline; with one, the last stage holds its own copy
("head.weight", kind "tied_copy").

Tensor parallelism over t (`tensor_parallel.apply`, `layers`, `kv_heads`), C = d_model, D =
head_dim, F = ffn_dim, K = n_kv_head, V = vocab_size:
    embedding, head     ceil(V/t) rows x C each rank (Megatron's vocab padding: the last
                        ranks' trailing rows are zeros, not the model's)
    wq; w_gate, w_up    column-parallel: C*C/t; F*C/t
    wo; w_down          row-parallel: C*C/t; C*F/t
    wk, wv              K % t == 0: split, K*D*C/t; t % K == 0 (t > K): one head copied on t/K
                        ranks, D*C ("kv_copy")
    norms               replicated: C on every rank ("replicated")
    biases (bias=True)  after their weight: a column bias split with its rows (O/t; a copied K/V
                        head's D, "kv_copy"), a row-parallel bias (wo, w_down) C, replicated
Context parallelism holds the parameters whole; it widens ZeRO's group to N = dp x cp.

An MoE GPT (`GPTConfig.moe_experts` E, `engine/expert.py`): an MoE block's MLP is its router
(E*C), the expert tensors w_gate, w_up, w_down (E/ep * C * F_e each, kind "expert": a rank stores
the E / ep experts of its place in the ep group) and the shared experts (S*F_e*C each), all whole
on every TP rank ("replicated" under tp). Under ZeRO the expert tensors form units of their own
(`ShardedOptimizer._split`: after the other units at stages 1-2, after their module's other unit
at stage 3), sharded over their expert-data-parallel group: dp / ep ranks, a rank's index in it
dp_rank // ep.

ZeRO over N = dp x cp (`zero.flat`, `zero.optimizer`, `stage1`-`stage3`, `stage3_manual`).
Units (one `FlatUnit` each; the engine passes one parameter group):
    stages 1-2  `split_into_units` of the rank's tensors in reverse order (buckets in backward's
                order): a new unit when the next tensor's bytes would pass reduce_bucket_size x
                (2 under fp16/bf16, else the model's element size); bytes counted at the model's
                dtype (units are cut before the parameters are rounded). At the default 5e8
                elements: one unit.
    stage 3     no pipeline: one unit per block (each element of the GPT's ModuleList), in
                block order, then the root unit (embedding, final norm, head); tensors of fewer
                than stage3_param_persistence_threshold elements go to one last unit and stay
                whole. Under a pipeline (`ZeroStage3Manual`): one unit per model stage on the
                rank, in stage order; no persistent tensors.
Each unit of n elements is padded to N * ceil(n / N) and rank r of the group (its index in the
sorted dp x cp group) owns [r s, (r + 1) s), s = ceil(n / N): the padding, at most N - 1
elements per unit, is all on the last ranks. The optimizer steps one tensor per *fragment*
(a tensor's non-empty intersection with the shard, cut again where a sub-group of
sub_group_size elements begins, counted over the rank's shards laid end to end).

Bytes, with B the parameters' bytes (2 under fp16/bf16, else the model's dtype_bytes M),
n the rank's tensor elements, S = sum of its shards s (padding included), R = the elements of
its fragments (no padding), f its fragments, T its tensors, k states per element (Adam: 2)
and c the optimizer's step counter bytes per tensor it steps (torch Adam: one float32, 4):
    stage   parameters        gradients     master_weights          optimizer_states
    0       B n               B n           M n under fp16/bf16     k M n + c T
    1, 2    B n               B S           M S                     k M R + c f
    3       B S'  + B n_pers  B S           M S                     k M R + c f
S' leaves out the persistent unit's shard, whose n_pers elements stay whole instead. At stage 1
the report is taken after the last backward, which reduce-scattered them: gradient shards (stage
1 holds whole ones, B n, between the micro-batches of an accumulation, not counted here). Categories are
summed over device, host and disk: offload moves bytes, it does not change them (not checked here).
At tp = pp = 1 with one unit this is `model_state_bytes(Psi, N, stage)` with Psi padded to a
multiple of N and the counters added (`pytest -k layout_memory_reduces`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from tinyscale.dist.mesh import MeshLayout
from tinyscale.models.config import GPTConfig
from tinyscale.pipeline.partition import partition_gpt

CATEGORIES = ("parameters", "gradients", "master_weights", "optimizer_states")
DEFAULT_BUCKET = 500_000_000  # zero_optimization.reduce_bucket_size's default (elements)
DEFAULT_SUB_GROUP = 1_000_000_000  # zero_optimization.sub_group_size's default (elements)


@functools.lru_cache(maxsize=256)
def cached_partition(cfg: GPTConfig, pp: int, virtual_stages: int) -> tuple:
    """`partition_gpt`, once per shape (a search asks for the same stages on every rank)."""
    return tuple(partition_gpt(cfg, pp, virtual_stages=virtual_stages))


@dataclass(frozen=True)
class LocalTensor:
    """One trainable parameter as a rank holds it, before ZeRO."""

    name: str      # its key in the original model ("head.weight" for a tied table's pipeline copy)
    numel: int     # elements held: the TP shard, vocab padding rows included
    real: int      # of which the model's own (numel minus vocab padding rows)
    kind: str      # "whole" | "shard" | "replicated" | "kv_copy" | "tied_copy"
    unit: int      # ZeRO stage 3's unit key (block index, root, or the pipeline stage's position)


# --8<-- [start:rank-tensors]
def rank_tensors(cfg: GPTConfig, plan, rank: int) -> list[LocalTensor]:
    """The trainable tensors `rank` of `plan`'s mesh holds, in `model.parameters()` order."""
    layout = MeshLayout(dp=plan.dp, tp=plan.tp, pp=plan.pp, cp=plan.cp)
    where = layout.coords(rank)
    t, r = plan.tp, where["tp"]
    C, D, F, K, V, L = cfg.d_model, cfg.head_dim, cfg.ffn_dim, cfg.kv_heads, cfg.vocab_size, cfg.n_layer
    if plan.pp > 1:
        stages = cached_partition(cfg, plan.pp, plan.virtual_stages)
        mine = sorted((s for s in stages if s.rank == where["pp"]), key=lambda s: s.stage)
        unit_of = {i: u for u, s in enumerate(mine) for i in s.layers}  # block -> its stage's position
        first, last = stages[0].rank == where["pp"], stages[-1].rank == where["pp"]
        embed_unit, head_unit = 0, len(mine) - 1
    else:
        unit_of, first, last, embed_unit, head_unit = {i: i for i in range(L)}, True, True, L, L  # L: the root
    rows = -(-V // t)  # a vocab table's rows per rank (all of them at t = 1)
    table_real = max(0, min(rows, V - r * rows)) * C
    kind = "shard" if t > 1 else "whole"
    out = []
    if first:
        out.append(LocalTensor("embed.weight", rows * C, table_real, kind, embed_unit))
    kv_split = K % t == 0
    kv = (K * D * C // t, "shard" if t > 1 else "whole") if kv_split else (D * C, "kv_copy")
    norm_kind = "replicated" if t > 1 else "whole"
    ep = getattr(plan, "ep", 1)
    for i in sorted(unit_of):
        block = [("attn_norm.weight", C, norm_kind), ("attn.wq.weight", C * C // t, kind),
                 ("attn.wk.weight", *kv), ("attn.wv.weight", *kv), ("attn.wo.weight", C * C // t, kind),
                 ("mlp_norm.weight", C, norm_kind)]
        if cfg.is_moe_layer(i):  # router, E / ep experts (kind "expert": ZeRO over edp), shared experts
            E, Fe, S = cfg.moe_experts, cfg.expert_dim, cfg.moe_shared_experts * cfg.expert_dim
            block += [("mlp.router.weight", E * C, norm_kind)]
            block += [(f"mlp.experts.{w}", E // ep * C * Fe, "expert") for w in ("w_gate", "w_up", "w_down")]
            block += [(f"mlp.shared.{w}.weight", S * C, norm_kind) for w in ("w_gate", "w_up", "w_down") if S]
        else:
            block += [("mlp.w_gate.weight", F * C // t, kind), ("mlp.w_up.weight", F * C // t, kind),
                      ("mlp.w_down.weight", C * F // t, kind)]
        out += [LocalTensor(f"blocks.{i}.{name}", n, n, k, unit_of[i]) for name, n, k in block]
    if last:
        out.append(LocalTensor("norm.weight", C, C, norm_kind, head_unit))
        if not cfg.tie_embeddings:
            out.append(LocalTensor("head.weight", rows * C, table_real, kind, head_unit))
        elif plan.pp > 1:  # the last stage's own copy of the tied table
            out.append(LocalTensor("head.weight", rows * C, table_real, "tied_copy", head_unit))
    return _with_biases(cfg, out, t) if cfg.bias else out
# --8<-- [end:rank-tensors]


def _with_biases(cfg: GPTConfig, tensors: list[LocalTensor], t: int) -> list[LocalTensor]:
    """`tensors` with each dense linear's bias after its weight (GPTConfig.bias): a row-parallel
    one (wo, w_down) whole on every rank, a column one a row of its weight's shard."""
    out = []
    for x in tensors:
        out.append(x)
        path, _, leaf = x.name.rpartition(".")
        if leaf != "weight" or not path.endswith((".attn.wq", ".attn.wk", ".attn.wv", ".attn.wo", ".mlp.w_gate",
                                                  ".mlp.w_up", ".mlp.w_down")):
            continue
        if path.endswith((".wo", ".w_down")):
            kind = "replicated" if t > 1 else "whole"
            out.append(LocalTensor(f"{path}.bias", cfg.d_model, cfg.d_model, kind, x.unit))
        else:  # (O/t, C) weight: O/t bias elements
            out.append(LocalTensor(f"{path}.bias", x.numel // cfg.d_model, x.real // cfg.d_model, x.kind, x.unit))
    return out


def rank_param_counts(cfg: GPTConfig, plan) -> dict[int, int]:
    """{rank: elements of the trainable tensors it holds before ZeRO} (TP padding rows included)."""
    return {rank: sum(x.numel for x in rank_tensors(cfg, plan, rank)) for rank in range(_world(plan))}


def _world(plan) -> int:
    return plan.dp * plan.pp * plan.cp * plan.tp


# --8<-- [start:units]
def zero_units(tensors: list[LocalTensor], stage: int, *, bucket_bytes: float, element_bytes: int,
               persistence_threshold: int = 0, pipeline: bool = False) -> tuple[list[list[int]], int]:
    """(ZeRO's units as lists of tensor sizes, in the order ShardedOptimizer builds them; how many
    trailing units are stage 3's persistent ones). `bucket_bytes` caps stages 1-2's units, each
    tensor weighing numel x `element_bytes`."""
    if stage == 3:
        keyed: dict[int, list[int]] = {}
        for x in tensors:
            persistent = not pipeline and x.numel < persistence_threshold
            keyed.setdefault(math.inf if persistent else x.unit, []).append(x.numel)
        return [keyed[k] for k in sorted(keyed)], int(math.inf in keyed)
    units: list[list[int]] = []
    size = 0
    for x in reversed(tensors) if stage in (1, 2) else tensors:
        nbytes = x.numel * element_bytes
        if not units or size + nbytes > bucket_bytes:
            units.append([])
            size = 0
        units[-1].append(x.numel)
        size += nbytes
    return units, 0
# --8<-- [end:units]


def _expert_units(tensors: list[LocalTensor], groups: tuple[tuple[int, int], tuple[int, int]], stage: int,
                  **kw) -> tuple[list[list[int]], int, list[tuple[int, int]]]:
    """`zero_units` with expert shards (kind "expert") in units of their own, as
    `ShardedOptimizer._split` cuts them: after the other units (stages 1-2), or after the other
    unit of the same module (stage 3); each unit's (group size, rank in it) from `groups`
    (dense, expert)."""
    dense = [x for x in tensors if x.kind != "expert"]
    experts = [x for x in tensors if x.kind == "expert"]
    if not experts:
        units, persistent = zero_units(tensors, stage, **kw)
        return units, persistent, [groups[0]] * len(units)
    if stage != 3:
        a, _ = zero_units(dense, stage, **kw)
        b, _ = zero_units(experts, stage, **kw)
        return a + b, 0, [groups[0]] * len(a) + [groups[1]] * len(b)
    keyed: dict[float, list[tuple[list[int], tuple[int, int]]]] = {}
    threshold, pipeline = kw.get("persistence_threshold", 0), kw.get("pipeline", False)
    for x in tensors:
        key = math.inf if not pipeline and x.numel < threshold else x.unit
        expert = int(x.kind == "expert")
        entry = keyed.setdefault(key, [([], groups[0]), ([], groups[1])])
        entry[expert][0].append(x.numel)
    units, unit_groups = [], []
    for key in sorted(keyed):
        for sizes, group in keyed[key]:
            if sizes:
                units.append(sizes)
                unit_groups.append(group)
    persistent = sum(1 for sizes, _ in keyed.get(math.inf, []) if sizes)
    return units, persistent, unit_groups


def shard_share(units: list[list[int]], n: int, r: int, sub_group: int = DEFAULT_SUB_GROUP,
                unit_groups: list[tuple[int, int]] | None = None) -> tuple[int, int, int]:
    """(shard elements S, fragment elements R, fragments f) of rank r of n over `units`;
    `unit_groups`: each unit's own (n, r) instead (expert shards are sharded over edp)."""
    shard_total = real = fragments = 0
    for k, sizes in enumerate(units):
        if unit_groups is not None:
            n, r = unit_groups[k]
        s = -(-sum(sizes) // n)  # ceil: each unit padded to a multiple of n
        lo, hi, start = r * s, (r + 1) * s, 0
        first_cut = -(-shard_total // sub_group) * sub_group - shard_total  # sub_groups.sub_group_starts
        cuts = [k for k in range(first_cut, s, sub_group) if k > 0]
        for size in sizes:
            a, b = max(lo, start) - lo, min(hi, start + size) - lo
            if a < b:
                real += b - a
                fragments += 1 + sum(a < c < b for c in cuts)
            start += size
        shard_total += s
    return shard_total, real, fragments


def rank_model_state_bytes(cfg: GPTConfig, plan, *, dtype_bytes: int = 4, compute_bytes: int | None = None,
                           states_per_element: int = 2, step_bytes: int = 4,
                           reduce_bucket_size: int = DEFAULT_BUCKET, sub_group_size: int = DEFAULT_SUB_GROUP,
                           stage3_param_persistence_threshold: int = 0,
                           ranks=None) -> dict[int, dict[str, int]]:
    """{rank: {category: bytes}} of the model states each rank holds before the optimizer step
    (see the module doc for the rules). `dtype_bytes`: the model's parameter dtype (masters and
    optimizer states are in it); `compute_bytes`: 2 under fp16/bf16 (parameters and gradients),
    None without; Adam defaults (`states_per_element` 2, a 4-byte `step` per stepped tensor);
    `reduce_bucket_size`, `sub_group_size`, `stage3_param_persistence_threshold`: zero_optimization's.
    `ranks`: only these ranks (default: every rank; the planner asks for a few of a large world)."""
    B, M, stage = compute_bytes or dtype_bytes, dtype_bytes, plan.zero_stage
    n_group = plan.dp * plan.cp
    layout = MeshLayout(dp=plan.dp, tp=plan.tp, pp=plan.pp, cp=plan.cp)
    out = {}
    for rank in range(_world(plan)) if ranks is None else ranks:
        tensors = rank_tensors(cfg, plan, rank)
        n = sum(x.numel for x in tensors)
        if stage == 0:
            out[rank] = {"parameters": B * n, "gradients": B * n, "master_weights": M * n if compute_bytes else 0,
                         "optimizer_states": states_per_element * M * n + step_bytes * len(tensors)}
            continue
        where = layout.coords(rank)  # its index in the sorted dp x cp group: ranks grow with dp, then cp
        groups = ((n_group, where["dp"] * plan.cp + where["cp"]),  # dense: dp x cp; expert shards: edp
                  (plan.dp // getattr(plan, "ep", 1), where["dp"] // getattr(plan, "ep", 1)))
        units, persistent, unit_groups = _expert_units(
            tensors, groups, stage, bucket_bytes=reduce_bucket_size * (2 if compute_bytes else M), element_bytes=M,
            persistence_threshold=stage3_param_persistence_threshold, pipeline=plan.pp > 1)
        S, R, f = shard_share(units, n_group, 0, sub_group_size, unit_groups)
        last = range(len(units) - persistent, len(units))  # stage 3's persistent units: their tensors whole
        whole = sum(sum(units[k]) for k in last)
        params = B * (S - sum(-(-sum(units[k]) // unit_groups[k][0]) for k in last) + whole) \
            if stage == 3 else B * n
        out[rank] = {"parameters": params, "gradients": B * S,
                     "master_weights": M * S, "optimizer_states": states_per_element * M * R + step_bytes * f}
    return out
