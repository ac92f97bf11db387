"""The layout plan: a config, a model and a world decided once (DESIGN.md, "One plan, one pass").

    plan = plan_layout(config, model, world_size)   # every refusal at once, before any process group
    plan.layout, plan.axis_jobs()                   # the (pp, dp, cp, tp) grid, what each axis does
    table = placements(engine)                      # after the transforms: where each parameter lives here
    GradNorm(engine)                                # engine/grad_norm.py: the clipping norm read from them

`plan_layout` runs every check the engine has (the config's own, the compression section's,
then tensor, context, pipeline and expert parallelism's with the model and the world) and raises
ONE `ConfigError` listing every problem, so a reader fixes a config in one round instead of one
error per run. What it returns is the grid, each axis's job, and every setting the transforms
read: the schedule and virtual stages, SP, the cp algorithm and sharding, TP's dropout mode,
AutoTP's plan (found by the check, carried here and applied as found: not searched twice), the
activation-checkpointing policy, the ZeRO section and stage 3's resharding under a pipeline.
`Engine.__init__` builds the mesh from it and applies the transforms in the order
`engine/parallelize.py` writes down, each given the plan, not the config: the validators that
`plan_layout` calls are the only code under engine/ that reads the config's `parallel` or
`zero_optimization` section (`pytest -k layout_plan` scans for any other reader, and builds and
trains engines whose config loses those sections as soon as `plan_layout` returns).

`placements(engine)` describes, for every parameter this rank holds, where it sits on each
axis: its tp split (replicated; a shard along a dim, maybe padded; a copy of a K/V head), the
pipeline stages that hold it (a tied table lives on the first and the last), and the part of
it this rank's ZeRO shard owns over dp x cp. From those alone follows which elements this rank
*counts* when something must see every parameter exactly once: the global gradient norm, the
memory report, checkpoints. `counted_elements` summed over one model replica (the world under
ZeRO, which shards over dp x cp too) is the model's size (`pytest -k layout_plan` checks that in
every layout); `engine/grad_norm.py` clips by the norm those elements give.

Shape legend: a placement's `global_shape` is the original model's tensor; `local_shape` is the
tensor this rank's module holds before ZeRO flattens it (a TP shard, with its padding rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tinyscale.config import ActivationCheckpointingConfig, CompileConfig, ConfigError, EngineConfig, ZeroConfig
from tinyscale.dist import ParallelMesh
from tinyscale.dist.mesh import MeshLayout
from tinyscale.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tinyscale.tensor_parallel.kv_heads import ReplicatedKVLinear

AXES = ("pp", "dp", "cp", "tp")  # the mesh's order: tp fastest (a TP group is consecutive ranks)


@dataclass(frozen=True)
class LayoutPlan:
    """The degrees of every axis and what each does, validated (`plan_layout` builds it)."""

    world_size: int
    dp: int
    pp: int
    cp: int
    tp: int
    virtual_stages: int = 1
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    context_algorithm: str = "ring"
    ep: int = 1  # expert parallelism: runs of ep dp ranks split the experts (engine/expert.py)
    moe: bool = False  # the model is an MoE GPT (its routing is logged in engine.last_step["moe"])
    # What the transforms read besides the degrees, copied from the config here: after plan_layout
    # nothing reads the config's parallel or zero_optimization section (`pytest -k layout_plan`).
    tensor_dropout: str = "exact"  # how TP ranks draw stream dropout masks (parallel.tensor_dropout)
    autotp: tuple[tuple[str, str], ...] = ()  # AutoTP's plan as found by the check: (module name, style)
    context_sharding: str = "zigzag"  # how cp cuts the sequence (zigzag, contiguous)
    pipeline_reshard_after_forward: bool = False  # ZeRO 3 under a pipeline: free a stage after each pass
    checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    # the section DP/ZeRO is built from, and the one record of the stage (`zero_stage` reads it): a plan
    # built by hand says `zero=ZeroConfig(stage=s)`, so no second field can disagree with it
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    # torch.compile of the blocks (engine/compiled.py); not in the plan's hash or equality (its compile_kwargs
    # is a dict, and a plan is a cache key of the planner's: compiling changes no byte of a layout)
    compile: CompileConfig = field(default_factory=CompileConfig, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.zero, ZeroConfig):
            raise TypeError(f"LayoutPlan.zero={self.zero!r}: pass a ZeroConfig, e.g. zero=ZeroConfig(stage=1) "
                            "(it is also where the plan's ZeRO stage lives: plan.zero_stage reads zero.stage)")

    @property
    def zero_stage(self) -> int:
        """ZeRO's stage over dp (x cp): the `zero` section's, the only place it is kept."""
        return self.zero.stage

    @property
    def layout(self) -> MeshLayout:
        return MeshLayout(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp)

    @property
    def reduce_axes(self) -> tuple[str, ...]:
        """The axes gradients are reduced (and ZeRO shards) over: dp, and cp when it is > 1."""
        return ("dp", "cp") if self.cp > 1 else ("dp",)

    def axis_jobs(self) -> dict[str, str]:
        """One line per axis of degree > 1: what it splits and what it communicates."""
        zero = {0: "gradients all-reduced", 1: "optimizer states sharded", 2: "gradients and states sharded",
                3: "parameters, gradients and states sharded"}[self.zero_stage]
        jobs = {
            "pp": f"{self.pp * self.virtual_stages} model stages ({self.virtual_stages} per rank), schedule "
                  f"{self.schedule}: activations sent forward, their gradients back",
            "dp": f"rows of the batch; {zero} over {' x '.join(self.reduce_axes)}",
            "cp": f"the sequence ({self.context_algorithm} attention); parameters replicated, gradients summed",
            "ep": f"experts, split over runs of {self.ep} dp ranks; tokens exchanged by all-to-all",
            "tp": "heads, MLP width and vocab (Megatron's f/g); "
                  + ("activations split along the sequence between them (SP)" if self.sequence_parallel
                     else "activations replicated between them"),
        }
        return {axis: jobs[axis] for axis in (*AXES, "ep") if getattr(self, axis) > 1}

    def describe(self) -> str:
        degrees = " x ".join(f"{a} {getattr(self, a)}" for a in AXES)
        return f"{self.world_size} ranks = {degrees}, ZeRO stage {self.zero_stage}"


def plan_layout(config: EngineConfig, model: nn.Module, world_size: int,
                mesh: ParallelMesh | None = None) -> LayoutPlan:
    """Validate `config` for `model` on `world_size` ranks in one pass; raise one `ConfigError`
    naming every problem (each with its field and fix), or return the plan. No collectives."""
    # Imported here: these modules build on the engine's pieces, which import this module's users.
    from tinyscale.engine import compiled, compression, context, expert, parallelize, pipeline_layout  # noqa: PLC0415

    problems = parallelize.check_config(config) + compression.check_config(config)
    if problems:  # the config alone: the "not supported" list, as check_supported words it
        problems = ["not supported by this engine yet:\n  " + "\n  ".join(problems)]
    autotp = None  # what check_tensor_layout found for a model tinyscale did not write, applied as found
    for check in (context.check_layout, pipeline_layout.check_layout, parallelize.check_tensor_layout,
                  expert.check_layout, compiled.check_layout):
        try:
            autotp = check(config, model, world_size, mesh) or autotp
        except ConfigError as exc:
            problems.append(str(exc))
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems with this layout:\n  " + "\n  ".join(problems))
    par = config.parallel
    tp, cp, pp = par.tensor, par.context, par.pipeline
    return LayoutPlan(world_size=world_size, dp=world_size // (tp * cp * pp), pp=pp, cp=cp, tp=tp,
                      virtual_stages=par.virtual_stages, schedule=par.pipeline_schedule,
                      sequence_parallel=par.sequence_parallel, context_algorithm=par.context_algorithm,
                      ep=par.expert,
                      moe=bool(getattr(getattr(model, "config", None), "moe_experts", 0)),
                      tensor_dropout=par.tensor_dropout, autotp=tuple((autotp or {}).items()),
                      context_sharding=par.context_sharding,
                      pipeline_reshard_after_forward=par.pipeline_reshard_after_forward,
                      checkpointing=config.activation_checkpointing, zero=config.zero_optimization,
                      compile=config.compile)


# --8<-- [start:placement]
@dataclass(frozen=True)
class Placement:
    """Where one parameter lives on this rank, axis by axis."""

    name: str                          # its key in the original model's state_dict
    global_shape: tuple[int, ...]      # the original tensor
    local_shape: tuple[int, ...]       # this rank's TP shard (padding rows included), before ZeRO
    tp: str = "replicate"              # "replicate" | "shard" | "kv_copy" (one of t/K copies of a K/V head)
    tp_dim: int | None = None          # the dim a shard splits
    tp_range: tuple[int, int] | None = None  # the global [start, end) along tp_dim held here, padding excluded
    tp_counted: bool = True            # this TP rank counts it (a shard: always; a copy: TP rank 0 / first copy)
    tp_runs: tuple[tuple[int, int, int], ...] = ()  # a shard of scattered rows (a fused layer's q, k, v
    # parts): (local start, local end, global start) along tp_dim per run; () = one run at tp_range
    stages: tuple[int, ...] = ()       # model stages holding it here (empty without a pipeline)
    pp_counted: bool = True            # False on the last stage's copy of a tied table (the first counts it)
    zero_ranges: tuple[tuple[int, int], ...] = field(default=())  # flat [start, end) of local_shape owned
    zero_sharded: bool = False         # ZeRO 1-3: only zero_ranges are this rank's (else all of it)
    ep_range: tuple[int, int] | None = None  # an expert shard: the experts [start, stop) of dim 0 held here
    reduce_over: str = "dp"            # the group it is reduced / ZeRO-sharded over: "dp" (x cp), or "edp"
    # (an expert shard: the dp / ep ranks holding the same experts; engine/expert.py)

    @property
    def real_local_elements(self) -> int:
        """Elements of the local shard that are the model's (not vocab padding): they lead the flat tensor."""
        if self.tp != "shard" or self.tp_range is None:
            return math.prod(self.local_shape)
        stride = math.prod(self.local_shape) // self.local_shape[self.tp_dim] if self.local_shape[self.tp_dim] else 0
        return (self.tp_range[1] - self.tp_range[0]) * stride

    @property
    def counted_elements(self) -> int:
        """The elements this rank counts so that the world counts every element exactly once."""
        if not (self.tp_counted and self.pp_counted):
            return 0
        real = self.real_local_elements
        if not self.zero_sharded:
            return real
        return sum(max(0, min(end, real) - start) for start, end in self.zero_ranges)
# --8<-- [end:placement]


def tp_placement(module: nn.Module, param: nn.Parameter, local_shape: tuple[int, ...],
                  global_shape: tuple[int, ...], group) -> dict:
    """The tp fields of `param`, a parameter of `module` (a TP layer, or a replicated module),
    on the tensor-parallel process group `group`."""
    tp_rank = dist.get_rank(group)
    if hasattr(module, "tp_split_dim"):  # a layer that says it (tensor_parallel/fused.py): no padding
        name = next(n for n, p in module.named_parameters(recurse=False) if p is param)
        dim = module.tp_split_dim(name)
        if dim is None:
            return {"tp": "replicate", "tp_counted": tp_rank == 0}
        rows = local_shape[dim] if len(local_shape) > dim else 0
        fields = {"tp": "shard", "tp_dim": dim, "tp_range": (tp_rank * rows, (tp_rank + 1) * rows)}
        index = getattr(module, "index", None)  # the global rows it holds (a fused column layer)
        if index is not None and len(index) == rows:
            runs, start = [], 0
            index = [int(i) for i in index]
            for k in range(1, rows + 1):
                if k == rows or index[k] != index[k - 1] + 1:
                    runs.append((start, k, index[start]))
                    start = k
            fields["tp_runs"] = tuple(runs)
        return fields
    if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)) or \
            (isinstance(module, RowParallelLinear) and param is module.weight):
        dim = 1 if isinstance(module, RowParallelLinear) else 0
        rows = local_shape[dim]  # (ZeRO-3 has flattened the parameter itself)
        start = tp_rank * rows
        return {"tp": "shard", "tp_dim": dim, "tp_range": (min(start, global_shape[dim]),
                                                           min(start + rows, global_shape[dim]))}
    if isinstance(module, ReplicatedKVLinear):  # copies on ranks head*t/K .. (head+1)*t/K - 1
        tp = dist.get_world_size(group)
        first = module.head * (tp // module.n_kv_head)
        return {"tp": "kv_copy", "tp_dim": 0, "tp_range": (module.head * local_shape[0],
                                                           (module.head + 1) * local_shape[0]),
                "tp_counted": tp_rank == first}
    return {"tp": "replicate", "tp_counted": tp_rank == 0}


def full_shape(module: nn.Module, leaf: str, local: tuple[int, ...]) -> tuple[int, ...]:
    """The original tensor's shape of `module`'s parameter `leaf`, a TP shard of shape `local`."""
    if hasattr(module, "full_shape"):  # a layer that says it (tensor_parallel/fused.py)
        return tuple(module.full_shape(leaf, torch.Size(local)))
    if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
        rows = module.out_features if isinstance(module, ColumnParallelLinear) else module.num_embeddings
        return (rows, *local[1:])
    if isinstance(module, RowParallelLinear) and leaf == "weight":
        return (module.out_features, module.in_features)
    if isinstance(module, ReplicatedKVLinear):  # (K*D, C), or a bias's (K*D,)
        return (module.n_kv_head * module.head_dim, *local[1:])
    return tuple(local)


def placements(engine, include_frozen: bool = False) -> dict[str, Placement]:
    """Where every parameter this rank holds lives, keyed by its name in the original model.

    Reads what the transforms left: the TP layers' shard sizes, the pipeline's stages and tied
    copy, ZeRO's fragments (call it between steps, on every rank or just this one: no collectives).
    `include_frozen`: frozen parameters too (checkpoints hold them; they are never ZeRO-sharded)."""
    model, pipeline, zero = engine.model, engine.pipeline, engine.zero
    tp = engine.plan.tp
    if pipeline is not None:  # the original model's shapes, under its names
        global_shapes = pipeline.full_shapes()
    else:
        global_shapes = engine._tp_shapes
        if tp > 1:
            global_shapes = {k: full_shape(model.get_submodule(k.rpartition(".")[0]), k.rpartition(".")[2], s)
                             for k, s in global_shapes.items()}
    owners = {}  # id(param) -> (its module, its first name)
    for mod_name, module in model.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), (module, f"{mod_name}.{p_name}" if mod_name else p_name))
    zero_ranges: dict[int, list[tuple[int, int]]] = {}
    if zero is not None:
        for fragments in zero.sharded.fragments:
            for f in fragments:
                zero_ranges.setdefault(id(f.param), []).append((f.param_start, f.param_start + f.end - f.start))
    stage_of = _stages_of(pipeline) if pipeline is not None else {}
    # the last stage's copy of a tied table (the first stage counts it); pp > 1, so they differ
    tied_copy = id(pipeline.tied[0]) if pipeline is not None and pipeline.tied is not None and \
        pipeline.rank == pipeline.plan[-1].rank else None
    from tinyscale.engine.expert import expert_fields, expert_placement  # noqa: PLC0415 - imports this module
    table = {}
    for param in (p for p in model.parameters() if p.requires_grad or include_frozen):
        module, name = owners[id(param)]
        local_shape = tuple(engine._tp_shapes.get(name, param.shape))
        key = pipeline.aliases.get(name, name) if pipeline is not None else name
        global_shape = tuple(global_shapes.get(key, local_shape))
        fields = tp_placement(module, param, local_shape, global_shape, engine.mesh.group("tp")) if tp > 1 else {}
        if id(param) == tied_copy:
            fields["pp_counted"] = False
        if getattr(param, "expert_shard", None) is not None:  # E / ep experts of the stacked tensor
            global_shape, fields = expert_placement(param, global_shape), fields | expert_fields(param)
        table[key] = Placement(name=key, global_shape=global_shape, local_shape=local_shape,
                               stages=stage_of.get(name.split(".")[0] if not name.startswith("blocks.")
                                                   else ".".join(name.split(".")[:2]), ()),
                               zero_ranges=tuple(sorted(zero_ranges.get(id(param), ()))),
                               zero_sharded=zero is not None and param.requires_grad, **fields)
    return table


def _stages_of(pipeline) -> dict[str, tuple[int, ...]]:
    """Module prefix ("embed", "blocks.3", "norm", "head") -> the model stages on this rank holding it."""
    out: dict[str, tuple[int, ...]] = {}
    for st in pipeline.plan:
        if st.rank != pipeline.rank:
            continue
        names = [f"blocks.{i}" for i in st.layers] + (["embed"] if st.embedding else []) + \
            (["norm", "head"] if st.head else [])
        for n in names:
            out[n] = out.get(n, ()) + (st.stage,)
    return out


# ---------------------------------------------------------------------------------------------
# Traffic by mesh axis (lesson 12, "Composing the layouts", DS-17): a ledger's rows split by the
# axis whose group each op ran over. Pure bookkeeping over `comm.Row.ranks`; no collectives.

# --8<-- [start:traffic-by-axis]
def axis_groups(layout: MeshLayout, rank: int) -> dict[str, tuple[int, ...]]:
    """The groups `rank` belongs to, by name, in the order an op's ranks are matched against them:
    each axis of degree > 1, then dp x cp flattened ("dp_cp", when both are > 1), then "world"."""
    groups = {axis: tuple(layout.group_ranks(axis, rank)) for axis in AXES if getattr(layout, axis) > 1}
    if layout.dp > 1 and layout.cp > 1:
        groups["dp_cp"] = next(tuple(g) for g in layout.flat_groups(("dp", "cp")) if rank in g)
    groups["world"] = tuple(range(layout.world_size))
    return groups


def axis_of(ranks: tuple[int, ...] | None, groups: dict[str, tuple[int, ...]]) -> str:
    """The name of the group an op ran over: the one with exactly its ranks; for a point-to-point
    pair, the first group holding both; "self" for a group of one, "other" if none matches."""
    if ranks is None:
        raise ValueError("a ledger row without ranks: record it with this version of tinyscale.dist.comm")
    wanted = set(ranks)
    if len(wanted) == 1:
        return "self"
    for name, group in groups.items():
        if set(group) == wanted:
            return name
    if len(ranks) == 2:  # a send or receive: the axis it crosses
        for name, group in groups.items():
            if wanted <= set(group):
                return name
    return "other"


def traffic_by_axis(ledger, mesh: ParallelMesh | MeshLayout, rank: int | None = None) -> dict[str, dict[str, dict]]:
    """{axis: {op: {"calls", "bytes", "bus_bytes"}}} of this rank's ledger (`comm.Ledger`), each row
    under the mesh group it ran over (`axis_groups`). A group that is two things at once (with
    world 2 and tp 2, the world *is* the tp group) counts under the first: the axis."""
    layout = mesh if isinstance(mesh, MeshLayout) else mesh.layout
    if rank is None:
        rank = dist.get_rank()
    groups = axis_groups(layout, rank)
    out: dict[str, dict[str, dict]] = {}
    for row in ledger.rows:
        per_op = out.setdefault(axis_of(row.ranks, groups), {})
        s = per_op.setdefault(row.op, {"calls": 0, "bytes": 0, "bus_bytes": 0.0})
        s["calls"] += 1
        s["bytes"] += row.bytes
        s["bus_bytes"] += row.bus_bytes
    return out
# --8<-- [end:traffic-by-axis]
