"""One layout on one cluster: bytes per GPU and seconds per step, each from the code's own parts.

    est = estimate(cfg, Layout(dp=32, tp=8, pp=4, zero_stage=1, policy="selective"), cluster,
                   global_batch=1024, seq_len=4096)
    est.memory   # worst GPU's device bytes: states, activations, buffers, total (+ host bytes)
    est.time     # seconds: compute, recompute, tp, cp, dp, optimizer, bubble, total; est.mfu

Memory per GPU (the largest over the pipeline ranks, both ends of the tp and ZeRO groups):
- model states: `engine.layout_memory.rank_model_state_bytes` of the layout's `LayoutPlan`, the
  function that equals `engine.memory_report` byte for byte (bf16 parameters and gradients, fp32
  masters and Adam states unless `dtype_bytes` says otherwise); offload moves masters and Adam
  states to the host. ZeRO 1 with more than one micro-batch holds whole gradients between them
  (the paper's 4 Psi + 12 Psi / N), not the shards `memory_report` sees after the last backward.
- activations: `layer_activation_bytes` (`checkpointing.formula.block_saved_bytes` split into the
  tensors tp shards and those it replicates unless SP shards them; cp divides the tokens) x the
  layers of the rank's fullest model stage x the rank's peak in-flight (micro-batch, stage)
  pairs, simulated (`pipeline.simulator`); the last stage adds the final norm and the logits' softmax
  (`extra_activation_bytes`); a checkpointed block's backward brings its activations back once.
- buffers: the gradient bucket (ZeRO 0-2) or stage 3's gathered unit and its prefetch.
A layout fits when the total is at most `USABLE` of the GPU's memory (the rest: CUDA context,
NCCL buffers, allocator fragmentation).

Time per step: FLOPs from `step_flops` (`tinyscale.mfu.layout_flops`: the causal half of attention
as a fused kernel computes it, its backward recomputing Q K^T; tp's padded vocabulary rows; what
checkpointing reruns, `ForwardFlops.recomputed`, with the non-re-entrant checkpoint's early stop:
a dense GPT's step is `ForwardFlops.hardware`'s count, tests/planner/test_planner_flops.py) at
`peak_flops x efficiency`, per model stage; tp's collectives (4 per layer per micro-batch, 6 with
full recomputation: all-reduces, or all-gathers and reduce-scatters under SP, the same ring time)
on the critical path; cp's ring passes overlapped with the attention they
feed; the pipeline's makespan from the simulator on those per-stage costs with the activation send
as latency (the bubble is what it adds over the slowest rank's busy time); dp's gradient reduction
overlapped with the last micro-batch's backward (stage 3: gathers per micro-batch, overlapped with
it), stage 1-2's parameter all-gather after the step exposed; the optimizer at HBM speed, or over
PCIe and the host's Adam when offloaded. Every collective costs its alpha-beta time on the link
its group crosses (`cluster.py`), plus the host's overhead per layer per micro-batch
(`Cluster.launch_overhead`). MFU counts attention's full T x T square (PaLM's and Megatron-LM's
convention, `tinyscale.mfu`'s default) while the time counts the causal half a fused kernel
computes, so at long sequences MFU can exceed `efficiency`. Not modelled: matmul efficiency falling for small shapes, overlap
inside tp, stragglers. A cluster without overlap (`Cluster.overlap=False`, CPU ranks) hides nothing.

An MoE GPT (lesson 13): an MoE block's feed-forward costs the router and each token's k kept
experts plus the shared ones (`moe_layer_flops`), whole on every tp rank (the engine leaves the
MoE unsplit by tp); with ep > 1, per MoE block and micro-batch, three all-to-alls in the forward
(the counts, then dispatch and combine of N k' rows of C elements) and two in the backward (three
more with full recomputation, which runs the forward again), N = b s tokens, each all-to-all
(ep-1) alpha + (ep-1)/ep n / beta on the ep group's link (`Cluster.link("ep")`), on the critical
path (the experts wait for their rows), bytes n as the ledger counts them (`moe_all_to_all_bytes`);
the expert shards' gradients reduced (ZeRO: reduce-scattered, gathered) over their edp group of
dp / ep ranks, as a collective of their own beside the dense one over dp. Routing is taken as
balanced (every ep rank computes and receives N k' rows); the busiest expert's rank, which sets
the pace when it is not, is not modelled. The MoE block's activations: `moe_activation_bytes`.
"""

from __future__ import annotations

import dataclasses
import functools

from tinyscale.config import ConfigError, EngineConfig, ZeroConfig
from tinyscale.dist.mesh import MeshLayout
from tinyscale.checkpointing.formula import upcast_bytes
from tinyscale.engine import expert
from tinyscale.engine.layout_memory import cached_partition, rank_model_state_bytes, rank_tensors
from tinyscale.engine.plan import LayoutPlan
from tinyscale.mfu import ForwardFlops, layout_flops, model_flops_per_token
from tinyscale.models.config import GPTConfig
from tinyscale.models.gpt import GPT
from tinyscale.moe import all_to_all_bytes
from tinyscale.pipeline.schedules import B, BW, F, W, add_communication, afab, interleaved_1f1b, one_f_one_b, zb_h1
from tinyscale.pipeline.simulator import simulate
from tinyscale.planner.cluster import Cluster

USABLE = 0.9  # of a GPU's memory; the rest is the CUDA context, NCCL's buffers, fragmentation
ADAM_BYTES = 28  # per element of a step on the device: read master, grad, m, v (16), write master, m, v (12)
DDP_BUCKET = 25 * 2**20  # torch DDP's bucket; ZeRO 1-2's reduce bucket is zero_optimization's


@dataclasses.dataclass(frozen=True)
class Layout:
    """One candidate: mesh degrees, schedule, ZeRO stage, offload, checkpointing, micro-batch."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    virtual_stages: int = 1
    schedule: str = "1f1b"
    zero_stage: int = 0
    offload: str = "none"
    policy: str = "none"
    micro_batch: int = 1
    sequence_parallel: bool | None = None  # None: on whenever tp > 1 (it only saves memory)
    ep: int = 1  # an MoE GPT's experts split over runs of ep dp ranks (parallel.expert; E / ep stored per rank)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def sp(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel

    def plan(self) -> LayoutPlan:
        return LayoutPlan(world_size=self.world, dp=self.dp, pp=self.pp, cp=self.cp, tp=self.tp,
                          virtual_stages=self.virtual_stages, schedule=self.schedule,
                          sequence_parallel=self.sp, zero=ZeroConfig(stage=self.zero_stage), ep=self.ep)

    def num_microbatches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.micro_batch)

    def config(self, global_batch: int) -> dict:
        """The engine config (DeepSpeed's keys, tinyscale's `parallel`) that runs this layout."""
        zero: dict = {"stage": self.zero_stage}
        if self.offload != "none":
            zero["offload_optimizer"] = {"device": self.offload}
        parallel: dict = {"tensor": self.tp, "pipeline": self.pp, "context": self.cp}
        if self.sp:
            parallel["sequence_parallel"] = True
        if self.ep > 1:
            parallel["expert"] = self.ep
        if self.pp > 1:
            parallel |= {"pipeline_schedule": self.schedule, "virtual_stages": self.virtual_stages}
        return {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": self.micro_batch,
                "gradient_accumulation_steps": self.num_microbatches(global_batch),
                "zero_optimization": zero, "activation_checkpointing": {"policy": self.policy},
                "parallel": parallel}

    def describe(self) -> str:
        parts = [f"tp {self.tp}" + (" sp" if self.sp else "")] if self.tp > 1 else []
        parts += [f"cp {self.cp}"] if self.cp > 1 else []
        if self.pp > 1:
            v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"pp {self.pp} {self.schedule}{v}")
        parts.append(f"dp {self.dp}" + (f" (ep {self.ep})" if self.ep > 1 else ""))
        off = f" +{self.offload}" if self.offload != "none" else ""
        return " x ".join(parts) + f", ZeRO {self.zero_stage}{off}, AC {self.policy}, b {self.micro_batch}"


# --8<-- [start:layer-activations]
def layer_activation_bytes(cfg: GPTConfig, b: int, s: int, p: int, policy: str, *, tp: int = 1,
                           sp: bool = False, cp: int = 1, moe: bool = False, ep: int = 1) -> float:
    """Bytes one block keeps for backward per micro-batch on one rank: `block_saved_bytes`'s
    tensors, those tp splits (q, k, v, wo's input, the MLP's, attention's log-sum-exp) over tp,
    the norms' insides (input, normalised input, 1/rms) over tp only under SP (Korthikanti et al.
    2022, sec. 4.2.2); the norms' outputs stay whole: they are the all-gathered inputs the
    column-parallel wq/wk/wv and w_gate/w_up save (Megatron gathers them again in backward
    instead). cp splits the tokens; ring attention (cp > 1) keeps k and v before the GQA repeat
    and its own output, accumulated in u, beside wo's input. ("sdpa" attention; dropout only under
    cp.) Dropout under cp (counter masks): both residual branches keep their p-byte mask (s b h
    each, split over tp under SP, as the residual stream is); ring attention keeps no more, since
    its backward redraws each block's probability mask from the positions (measured at cp 2 and 3,
    bf16 and float32; the blocks it materialises meanwhile are transient, not counted). Each
    in its dtype: p bytes, but the norms' upcast input and 1/rms, the log-sum-exp and ring's output
    in at least float32 (u = 4 under bf16 / fp16: `checkpointing.formula.upcast_bytes`). `moe`: an
    MoE block, whose feed-forward keeps `moe_activation_bytes` instead of the SwiGLU's four (whole
    on every tp rank)."""
    mlp_saved = moe_activation_bytes(cfg, b, s, p, ep) if moe and policy in ("none", "selective") else 0.0
    s, h, F, kv, a, u = s / cp, cfg.d_model, cfg.ffn_dim, cfg.kv_dim, cfg.n_head, upcast_bytes(p)
    F = 0 if moe else F  # an MoE block has no dense SwiGLU
    norms = u * (2 * s * b * h + 2 * s * b) + p * 2 * s * b * h  # two RMSNorms: input, 1/rms; normalised input
    if cfg.dropout > 0 and cp > 1:  # the two residual dropout masks, on the residual stream's tokens
        norms += p * 2 * s * b * h
    gathered = p * 2 * s * b * h  # their outputs, as the column-parallel layers save them
    if policy == "full":
        return p * s * b * h / (tp if sp else 1)  # the block's input
    if policy == "offload":
        return 0.0
    if policy == "selective":  # q and wo's input, k and v before the GQA repeat, the MLP's four
        split = p * (2 * s * b * h + 2 * s * b * kv + 4 * s * b * F)
    elif policy == "none" and cp > 1:  # ring attention: q, k and v unrepeated, its output in u, wo's input
        split = p * (2 * s * b * h + 2 * s * b * kv + 4 * s * b * F) + u * (s * b * h + a * s * b)
    elif policy == "none":  # q, repeated k and v, wo's input, the MLP's four, the log-sum-exp
        split = p * (4 * s * b * h + 4 * s * b * F) + u * a * s * b
    else:
        raise ValueError(f"policy {policy!r}: the planner knows none, selective, full, offload")
    return norms / (tp if sp else 1) + gathered + split / tp + mlp_saved
# --8<-- [end:layer-activations]


# --8<-- [start:moe-activations]
def kept_per_token(cfg: GPTConfig) -> float:
    """Expert assignments a token keeps under balanced routing: k, or k x cf when a capacity
    factor cf < 1 caps each expert at cf N k / E rows (the engine sends and computes kept rows
    only, unpadded: `tinyscale.moe.dispatch`); imbalance, which drops more, is not modelled."""
    cf = cfg.moe_capacity_factor
    return cfg.moe_top_k * (1.0 if cf is None else min(1.0, cf))


def moe_activation_bytes(cfg: GPTConfig, b: int, s: int, p: int, ep: int = 1) -> float:
    """Bytes an MoE feed-forward keeps for backward per micro-batch on one rank, beside its input
    (the norm's output, counted by the block), with N = b s tokens and M = N k kept assignments
    (`kept_per_token`), C d_model, F_e an expert's width, S shared experts, E experts:
    the dispatched rows, the expert outputs and their weighted copy (3 M C), each expert's
    SwiGLU insides (4 M F_e, as a dense MLP's four) and the combine weights (M), in the compute
    dtype; the shared experts' SwiGLU insides (4 N S F_e); the router's logits, probabilities
    and top-k weights in float32 at least (N (2E + k + 2) + E); the int64 top-k and token indices
    (N k + 2 M). With ep > 1 the experts run on the R rows a rank receives (the same M on average),
    sorted by expert: their input and SwiGLU insides are R rows, the returned outputs and their
    weighted copy M rows, still 3 M C; the rows sent and the experts' outputs before the way back
    are not kept (the all-to-all keeps nothing, combine's `index_put` only the order); the sort
    adds its int64 order (R = M). Not split by tp: every tp rank runs the whole MoE on its tokens
    (`tensor_parallel.apply`). Read off the saved tensors of one MoE forward at ep 1 and 2."""
    N = b * s
    M = N * kept_per_token(cfg)
    C, Fe, E, k = cfg.d_model, cfg.expert_dim, cfg.moe_experts, cfg.moe_top_k
    return (p * (M * (3 * C + 4 * Fe + 1) + 4 * N * cfg.moe_shared_experts * Fe)
            + max(p, 4) * (N * (2 * E + k + 2) + E) + 8 * (N * k + 2 * M + (M if ep > 1 else 0)))
# --8<-- [end:moe-activations]


def extra_activation_bytes(cfg: GPTConfig, b: int, s: int, p: int, *, tp: int = 1, sp: bool = False,
                           cp: int = 1, first: bool, last: bool) -> float:
    """What the embedding and the head keep per micro-batch, to the byte (measured in bf16 and
    float64 at tp 1, 2, 2 + SP): the token ids (int64) and, under tp, the vocab-parallel
    embedding's bool mask of ids outside the rank's rows; the final norm (upcast input and 1/rms
    in u = `upcast_bytes(p)`, normalised input), its output (gathered under SP) as the head saves
    it, the softmax over this rank's vocab shard (u: the loss runs in at least float32) and the
    loss's targets: int64 (and 4 bytes of weight, tp 1) or, under tp, an int64 index and a bool."""
    s, h, u = s / cp, cfg.d_model, upcast_bytes(p)
    out = (8 * s * b + (s * b if tp > 1 else 0)) if first else 0.0
    if last:
        out += (u * (s * b * h + s * b) + p * s * b * h) / (tp if sp else 1) + p * s * b * h  # norm; its output
        out += u * s * b * -(-cfg.vocab_size // tp)  # the softmax over this rank's vocab rows
        out += 9 * s * b if tp > 1 else 8 * s * b + u  # the loss's targets
    return out


@functools.lru_cache(maxsize=8)
def _meta_gpt(cfg: GPTConfig) -> GPT:
    """The model on the meta device: shapes, no memory (0.2 s for Mixtral 8x7B's 47B)."""
    return GPT(cfg, device="meta")


@functools.lru_cache(maxsize=4096)
def _expert_refusal(cfg: GPTConfig, world: int, parallel: tuple) -> str | None:
    """The engine's own words (`engine.expert.check_layout`, run by `plan_layout`) on an ep > 1
    or MoE layout: ep dividing dp and E, no cp, no SP with an MoE GPT."""
    try:
        config = EngineConfig.load({"train_batch_size": world, "parallel": dict(parallel)})
        expert.check_layout(config, _meta_gpt(cfg), world)
    except ConfigError as exc:
        return str(exc)
    return None


def check_layout(cfg: GPTConfig, lay: Layout, global_batch: int, seq_len: int) -> str | None:
    """Why the engine (or arithmetic) cannot run `lay`, or None. An MoE GPT's (or ep > 1) layout
    is also asked of the engine's expert check, whose reason is returned as it words it."""
    if cfg.moe_experts or lay.ep > 1:
        refusal = _expert_refusal(cfg, lay.world, tuple(lay.config(global_batch)["parallel"].items()))
        if refusal:
            return refusal
    K = cfg.kv_heads
    if cfg.n_head % lay.tp or (K % lay.tp and lay.tp % K):
        return f"tp {lay.tp} splits neither {cfg.n_head} heads nor {K} K/V heads"
    if global_batch % (lay.dp * lay.micro_batch):
        return f"global batch {global_batch} is not a multiple of dp {lay.dp} x b {lay.micro_batch}"
    if seq_len % (2 * lay.cp * (lay.tp if lay.sp else 1)) and lay.cp > 1:
        return f"seq {seq_len} does not split into 2 cp {lay.cp} zigzag chunks of whole tp shards"
    if lay.pp * lay.virtual_stages > cfg.n_layer:
        return f"pp {lay.pp} x v {lay.virtual_stages} stages > {cfg.n_layer} layers"
    return None


def model_state_bytes(cfg: GPTConfig, lay: Layout, *, ranks=None, dtype_bytes: int = 4,
                      compute_bytes: int | None = 2) -> dict[int, dict[str, int]]:
    """{rank: {parameters, gradients, master_weights, optimizer_states}} as the engine holds them
    (`engine.layout_memory.rank_model_state_bytes` of the layout's plan; AdamW, default buckets)."""
    return rank_model_state_bytes(cfg, lay.plan(), dtype_bytes=dtype_bytes, compute_bytes=compute_bytes, ranks=ranks)


@functools.lru_cache(maxsize=4096)
def _states(cfg: GPTConfig, plan: LayoutPlan, dtype_bytes: int, compute_bytes: int | None) -> tuple[int, ...]:
    """(parameters, gradients, masters, optimizer states) of the rank with the most, over every
    pipeline rank at both ends of its tp group and of its ZeRO group (dp x cp)."""
    layout = MeshLayout(dp=plan.dp, tp=plan.tp, pp=plan.pp, cp=plan.cp)
    ranks = sorted({layout.rank_of(pp=i, dp=d, cp=c, tp=t) for i in range(plan.pp)
                    for d, c in ((0, 0), (plan.dp - 1, plan.cp - 1)) for t in (0, plan.tp - 1)})
    states = rank_model_state_bytes(cfg, plan, dtype_bytes=dtype_bytes, compute_bytes=compute_bytes, ranks=ranks)
    worst = max(states, key=lambda r: sum(states[r].values()))
    row = states[worst]
    return row["parameters"], row["gradients"], row["master_weights"], row["optimizer_states"], worst


@functools.lru_cache(maxsize=4096)
def _rank_elements(cfg: GPTConfig, plan: LayoutPlan, rank: int) -> tuple[int, int, int]:
    """(elements `rank` holds before ZeRO, those of its largest block, those of its expert shards:
    reduced and ZeRO-sharded over edp when ep > 1; at ep 1 they sit in dp's buckets like the rest)."""
    tensors = rank_tensors(cfg, plan, rank)
    blocks: dict[str, int] = {}
    for x in tensors:
        if x.name.startswith("blocks."):
            key = x.name.split(".")[1]
            blocks[key] = blocks.get(key, 0) + x.numel
    experts = sum(x.numel for x in tensors if x.kind == "expert") if plan.ep > 1 else 0
    return sum(x.numel for x in tensors), max(blocks.values(), default=0), experts


def _compute_schedule(name: str, p: int, m: int, v: int):
    return {"afab": lambda: afab(p, m), "1f1b": lambda: one_f_one_b(p, m), "zb_h1": lambda: zb_h1(p, m),
            "interleaved_1f1b": lambda: interleaved_1f1b(p, m, v)}[name]()


@functools.lru_cache(maxsize=8)  # a schedule of a large pipeline is 10^5 actions: keep few
def _schedule(name: str, p: int, m: int, v: int):
    return add_communication(_compute_schedule(name, p, m, v))


@functools.lru_cache(maxsize=4096)
def _peak_held(name: str, p: int, m: int, v: int, held: tuple) -> tuple:
    """Per pipeline rank, the most that its chunks hold at once when model stage k's forward keeps
    `held[k]` until its BW or W frees it (the simulator's in-flight rule). The count depends on each
    rank's order of actions, not on when they run, so it is walked on the lists, unsimulated."""
    peaks = []
    for actions in _compute_schedule(name, p, m, v):
        now = peak = 0
        for a in actions:
            now += held[a.stage] if a.kind == F else -held[a.stage] if a.kind in (BW, W) else 0
            peak = max(peak, now)
        peaks.append(peak)
    return tuple(peaks)


@functools.lru_cache(maxsize=4096)
def _in_flight(name: str, p: int, m: int, v: int, simulated: bool) -> tuple[int, ...]:
    """Peak in-flight (micro-batch, chunk) pairs per pipeline rank, all its chunks at once:
    counted on the schedule's lists as the simulator counts them (`_peak_held` of ones), or the
    schedules' closed forms (afab m; 1f1b and ZB-H1 min(p - r, m) and min(p, m); interleaved: rank
    r's warm-up 2(p - r - 1) + (v - 1)p forwards + 1, at most v m)."""
    if simulated:
        return _peak_held(name, p, m, v, (1,) * (p * v))
    per_rank = {"afab": lambda r: m, "1f1b": lambda r: min(p - r, m), "zb_h1": lambda r: min(p, m),
                "interleaved_1f1b": lambda r: min(2 * (p - r - 1) + (v - 1) * p + 1, v * m)}[name]
    return tuple(per_rank(r) for r in range(p))


@functools.lru_cache(maxsize=1024)
def _makespan(name: str, p: int, m: int, v: int, fwd: tuple, bwd: tuple, send: float) -> float:
    """The simulated step of schedule `name` with model stage k's forward `fwd[k]` and backward
    `bwd[k]` (zero bubble's B and W half of it each) and `send` latency per message: once per
    distinct costing (layouts that differ only in ZeRO stage or offload share it)."""
    kinds = {F: lambda a: fwd[a.stage], BW: lambda a: bwd[a.stage], B: lambda a: bwd[a.stage] / 2,
             W: lambda a: bwd[a.stage] / 2}
    return simulate(_schedule(name, p, m, v), lambda a: kinds[a.kind](a), latency=send).makespan


@dataclasses.dataclass
class Estimate:
    layout: Layout
    memory: dict
    time: dict
    mfu: float
    fits: bool
    problem: str | None = None


def estimate(cfg: GPTConfig, lay: Layout, cluster: Cluster, *, global_batch: int, seq_len: int,
             dtype_bytes: int = 4, compute_bytes: int | None = 2, simulate_pipeline: bool = True) -> Estimate:
    """Memory per GPU and time per step of `lay` (see the module doc). `simulate_pipeline=False`
    costs the pipeline by the closed form (p-1)/(v m + p-1) instead (the search's first pass)."""
    problem = check_layout(cfg, lay, global_batch, seq_len)
    if problem:
        return Estimate(lay, {}, {}, 0.0, False, problem)
    p, b, s, tp, cp, sp = compute_bytes or dtype_bytes, lay.micro_batch, seq_len, lay.tp, lay.cp, lay.sp
    m = lay.num_microbatches(global_batch)
    # model states do not depend on the schedule: 1F1B and ZB-H1 share one cache entry
    plan = dataclasses.replace(lay, schedule="1f1b" if lay.virtual_stages == 1 else lay.schedule).plan()
    params, grads, masters, states, worst = _states(cfg, plan, dtype_bytes, compute_bytes)
    if lay.zero_stage == 1 and m > 1:  # stage 1 accumulates whole gradients between micro-batches
        grads = params  # B n (its parameters are whole too); memory_report's snapshot after backward has shards
    host = 0
    if lay.offload != "none":
        host, masters, states = masters + states, 0, 0
    if params + grads + masters + states > USABLE * cluster.gpu_mem:  # pruned: no activations, no time
        memory = {"parameters": params, "gradients": grads, "master_weights": masters, "optimizer_states": states,
                  "activations": 0, "buffers": 0, "host": host, "total": params + grads + masters + states}
        return Estimate(lay, memory, {}, 0.0, False, f"its model states alone need {memory['total'] / 1e9:.1f} GB "
                                                     f"> {USABLE * cluster.gpu_mem / 1e9:.1f} GB usable")
    stages = cached_partition(cfg, lay.pp, lay.virtual_stages) if lay.pp > 1 else None
    if lay.schedule == "interleaved_1f1b" and m % lay.pp:
        return Estimate(lay, {}, {}, 0.0, False, f"interleaved 1F1B needs {m} micro-batches to be a multiple of pp {lay.pp}")
    layer, whole = ({moe: layer_activation_bytes(cfg, b, s, p, policy, tp=tp, sp=sp, cp=cp, moe=moe, ep=lay.ep)
                     for moe in (False, True)} for policy in (lay.policy, "none"))

    def blocks(layers) -> float:  # what a run of blocks keeps: dense ones and MoE ones
        n_moe = sum(cfg.is_moe_layer(i) for i in layers) if cfg.moe_experts else 0
        return (len(layers) - n_moe) * layer[False] + n_moe * layer[True]

    if stages is None:
        acts = [blocks(range(cfg.n_layer)) + extra_activation_bytes(cfg, b, s, p, tp=tp, sp=sp, cp=cp, first=True,
                                                                    last=True)]
    else:
        held = tuple(blocks(st.layers) + extra_activation_bytes(cfg, b, s, p, tp=tp, sp=sp, cp=cp, first=st.embedding,
                                                                last=st.head) for st in stages)
        if simulate_pipeline:  # each rank's peak of the bytes its chunks hold, walked in its own order
            acts = list(_peak_held(lay.schedule, lay.pp, m, lay.virtual_stages, held))
        else:  # the closed form's count at the rank's fullest chunk
            in_flight = _in_flight(lay.schedule, lay.pp, m, lay.virtual_stages, False)
            acts = [in_flight[r] * max(held[st.stage] for st in stages if st.rank == r) for r in range(lay.pp)]
    back = max(whole[moe] - layer[moe] for moe in {cfg.is_moe_layer(i) for i in range(cfg.n_layer)})
    acts = [a + back for a in acts]  # one checkpointed block's backward brings its tensors back
    # buffers: the gradient bucket, or stage 3's largest gathered unit (a block) and its prefetch
    n_rank, block, n_expert = _rank_elements(cfg, plan, worst)
    buffers = {0: min(DDP_BUCKET, p * n_rank), 1: p * min(n_rank, 5e8), 2: p * min(n_rank, 5e8),
               3: 2 * p * max(block, 1)}[lay.zero_stage]
    memory = {"parameters": params, "gradients": grads, "master_weights": masters, "optimizer_states": states,
              "activations": max(acts), "buffers": buffers, "host": host}
    memory["total"] = params + grads + masters + states + max(acts) + buffers
    fits = memory["total"] <= USABLE * cluster.gpu_mem
    time = _step_time(cfg, lay, cluster, m, s, p, stages, simulate_pipeline, n_rank, n_expert)
    tokens = global_batch * seq_len
    mfu = model_flops_per_token(cfg, seq_len) * tokens / (time["total"] * lay.world * cluster.peak_flops)
    problem = None if fits else f"needs {memory['total'] / 1e9:.1f} GB > {USABLE * cluster.gpu_mem / 1e9:.1f} GB usable"
    return Estimate(lay, memory, time, mfu, fits, problem)


# --8<-- [start:moe-time]
def moe_layer_flops(cfg: GPTConfig, s: int) -> float:
    """Forward matmul FLOPs of one MoE feed-forward over one sequence of s tokens, on the rank that
    routes them: the router (2 C E per token) and each kept assignment's SwiGLU expert plus the
    shared experts (6 C F_e each): s (2 C E + 6 C F_e (k' + S)), k' = `kept_per_token` (at k' = k,
    `tinyscale.mfu.mlp_flops_per_token`'s MoE term). Not E experts' worth, and not the dense
    SwiGLU's 6 C F. With ep, a rank computes E / ep experts on the rows of all its ep group, the
    same k' s rows on average (balanced routing); under tp every tp rank runs it whole."""
    C, Fe = cfg.d_model, cfg.expert_dim
    return s * (2 * C * cfg.moe_experts + 6 * C * Fe * (kept_per_token(cfg) + cfg.moe_shared_experts))


def moe_all_to_all_bytes(cfg: GPTConfig, lay: Layout, seq_len: int, p: int) -> dict[str, float]:
    """The bytes one rank's all-to-alls carry for one MoE layer and one micro-batch, as the comm
    ledger records them (an all-to-all's input size), by `tinyscale.moe.all_to_all_bytes`: the
    counts (E int64) once, then the N k' rows of C elements out and back in the forward (dispatch,
    combine: 2 N k' C p) and again reversed in the backward (2 N k' C p), with N = b s tokens. At
    ep 1 there are none. Summed over an ep group's ranks this is exact whatever the routing (each
    kept assignment is sent once and received once) when nothing is dropped; one rank's own share
    is its routing's."""
    if lay.ep == 1:
        return {"counts": 0, "forward": 0, "backward": 0}
    rows = lay.micro_batch * seq_len * kept_per_token(cfg)
    return all_to_all_bytes(cfg.moe_experts, rows, rows, cfg.d_model, p)
# --8<-- [end:moe-time]


# --8<-- [start:step-flops]
def step_flops(cfg: GPTConfig, lay: Layout, seq_len: int) -> ForwardFlops:
    """The matmul FLOPs one sequence costs on `lay`'s tp x cp ranks together, as a GPU runs them:
    `tinyscale.mfu.layout_flops` (tp's padded vocabulary rows, ring attention's blocks under cp)
    with the attention core the layout runs. A fused kernel (sdpa, ring attention's blocks) computes
    the causal half and its backward recomputes Q K^T (`backward_rerun`: Q K^T and P V cost 2.5x
    their forward in backward, not 2x); an explicit core (attn_impl "math", counter dropout masks,
    or dropout under tp: `engine.throughput.explicit_core_of` on a GPU) multiplies the whole square
    and keeps P; ring attention under dropout runs merge.py's whole blocks, and still recomputes."""
    explicit = True if cfg.dropout > 0 and lay.tp > 1 else None  # None: the config's answer
    flops = layout_flops(cfg, seq_len, tp=lay.tp, cp=lay.cp, causal=True, explicit_core=explicit)
    if flops.backward_rerun == 0 or (lay.cp > 1 and cfg.dropout > 0):  # no fused kernel: the whole square
        flops = layout_flops(cfg, seq_len, tp=lay.tp, cp=lay.cp, causal=False, explicit_core=explicit)
    return flops
# --8<-- [end:step-flops]


def _step_time(cfg, lay, cluster, m, s, p, stages, simulate_pipeline, n_rank, n_expert) -> dict:
    """Seconds per step by part (see the module doc); parts sum to `total`."""
    degrees = {"pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "tp": lay.tp, "ep": lay.ep}
    rate = cluster.peak_flops * cluster.efficiency
    fl, L, share = step_flops(cfg, lay, s), cfg.n_layer, lay.micro_batch / (lay.tp * lay.cp)  # share: one rank's
    C, F = cfg.d_model, cfg.ffn_dim
    per_layer = ((fl.qkvo + fl.attention) / L + s * 6 * C * F) * share  # a dense block: its SwiGLU 6 s C F
    moe_layer = ((fl.qkvo + fl.attention) / L * share + moe_layer_flops(cfg, s) / lay.cp * lay.micro_batch) \
        if cfg.moe_experts else 0.0
    attn_layer = fl.attention / L * share
    rerun_layer = fl.backward_rerun / L * share  # Q K^T again in a fused core's backward
    head = fl.head * share
    # full recomputation stops early (non-re-entrant checkpoint, `ForwardFlops.recomputed`): not at
    # w_down (an MoE block's shared experts' w_down), whose output nothing saves, unless dropout does
    unsaved, unsaved_moe = (0, 0) if cfg.dropout > 0 else (2 * s * C * F, 2 * s * C * cfg.moe_shared_experts
                                                          * cfg.expert_dim)
    recompute = {"none": 0.0, "offload": 0.0, "selective": fl.recomputed("selective") / L * share,
                 "full": per_layer - unsaved * share}[lay.policy]
    recompute_moe = moe_layer - unsaved_moe / lay.cp * lay.micro_batch if lay.policy == "full" else recompute
    ep_link = cluster.link("ep", degrees)
    a2a = moe_all_to_all_bytes(cfg, lay, s, p)
    rows_one = a2a["forward"] / 2  # one all-to-all of the rows
    ep_fwd = ep_link.all_to_all(a2a["counts"], lay.ep) + 2 * ep_link.all_to_all(rows_one, lay.ep)
    ep_bwd = 2 * ep_link.all_to_all(rows_one, lay.ep) + (ep_fwd if lay.policy == "full" else 0.0)
    act = lay.micro_batch * s / lay.cp * cfg.d_model * p  # one (b, s/cp, h) activation
    tp_link, cp_link = cluster.link("tp", degrees), cluster.link("cp", degrees)
    tp_one = tp_link.all_reduce(act, lay.tp)  # = all-gather + reduce-scatter under SP
    tp_fwd, tp_bwd = 2 * tp_one, (4 if lay.policy == "full" else 2) * tp_one
    kv_chunk = 2 * lay.micro_batch * s / lay.cp * cfg.kv_dim / lay.tp * p  # K and V of one cp shard
    hide = 1.0 if cluster.overlap else 0.0  # share of the compute beside it that hides communication
    cp_fwd = max(0.0, (lay.cp - 1) * cp_link.send(kv_chunk) - hide * attn_layer / rate) if lay.cp > 1 else 0.0
    cp_bwd = max(0.0, (lay.cp - 1) * cp_link.send(2 * kv_chunk) - hide * (2 * attn_layer + rerun_layer) / rate) \
        if lay.cp > 1 else 0.0
    launch = cluster.launch_overhead

    def stage_cost(blocks, last: bool) -> tuple[dict, float]:
        """(parts of one micro-batch's forward + backward on a stage of `blocks`, its forward alone)."""
        n_moe = sum(cfg.is_moe_layer(i) for i in blocks) if cfg.moe_experts else 0
        layers, dense = len(blocks), len(blocks) - n_moe
        forward = (dense * per_layer + n_moe * moe_layer + head * last) / rate + (layers + last) * launch
        fwd = forward + layers * (tp_fwd + cp_fwd) + n_moe * ep_fwd
        return {"compute": 3 * forward + layers * rerun_layer / rate,  # backward: 2 forwards and the rerun
                "recompute": (dense * recompute + n_moe * recompute_moe) / rate,
                "tp": layers * (tp_fwd + tp_bwd), "cp": layers * (cp_fwd + cp_bwd),
                "ep": n_moe * (ep_fwd + ep_bwd)}, fwd

    if stages is None:
        one, fwd_one = stage_cost(range(cfg.n_layer), True)
        parts = {k: m * v for k, v in one.items()}
        parts["bubble"] = 0.0
        t_bwd_last = sum(one.values()) - fwd_one
    else:
        costs = {st.stage: stage_cost(st.layers, st.head) for st in stages}
        fwd = {k: f for k, (_, f) in costs.items()}
        bwd = {k: sum(c.values()) - fwd[k] for k, (c, _) in costs.items()}
        ranks = {r: [st.stage for st in stages if st.rank == r] for r in range(lay.pp)}
        busy = {r: m * sum(fwd[k] + bwd[k] for k in ks) for r, ks in ranks.items()}
        slow = max(busy, key=busy.get)
        parts = {k: m * sum(costs[st][0][k] for st in ranks[slow]) for k in ("compute", "recompute", "tp", "cp", "ep")}
        send = cluster.link("pp", degrees).send(act / (lay.tp if lay.sp else 1))
        if simulate_pipeline:
            order = sorted(fwd)
            makespan = _makespan(lay.schedule, lay.pp, m, lay.virtual_stages, tuple(fwd[k] for k in order),
                                 tuple(bwd[k] for k in order), send)
        else:  # closed form for equal stages at the slowest one's costs; the first micro-batch's
            v, pp = lay.virtual_stages, lay.pp  # sends cross all pp v stages, forward and back
            makespan = busy[slow] * (1 + (pp - 1) / (v * m) / (3 if lay.schedule == "zb_h1" else 1)) \
                + 2 * (pp * v - 1) * send
        parts["bubble"] = makespan - busy[slow]
        t_bwd_last = bwd[stages[-1].stage]
    # the dense parameters over dp x cp; expert shards (ep > 1) over their edp group, dp / ep ranks
    # in dp's block of ranks (so on dp's link), as separate collectives
    groups = [(n_rank - n_expert, lay.dp * lay.cp)] + ([(n_expert, lay.dp // lay.ep)] if n_expert else [])
    dp_link = cluster.link("dp", degrees)
    if lay.zero_stage == 3:  # per micro-batch: gather for forward, again for backward, reduce-scatter
        per_mb = sum(2 * dp_link.all_gather(p * n, k) + dp_link.reduce_scatter(p * n, k) for n, k in groups)
        compute_mb = (parts["compute"] + parts["recompute"]) / m
        parts["dp"] = m * max(0.0, per_mb - hide * compute_mb)
    else:
        reduce = sum(dp_link.all_reduce(p * n, k) for n, k in groups)  # = reduce-scatter + all-gather's halves
        after = sum(dp_link.all_gather(p * n, k) for n, k in groups) if lay.zero_stage in (1, 2) else 0.0
        reduce = sum(dp_link.reduce_scatter(p * n, k) for n, k in groups) if lay.zero_stage in (1, 2) else reduce
        parts["dp"] = max(0.0, reduce - hide * t_bwd_last) + after
    shard = sum(n / (k if lay.zero_stage else 1) for n, k in groups)
    if lay.offload != "none":
        parts["optimizer"] = 2 * p * shard / cluster.host_bw + shard / cluster.host_adam
    else:
        parts["optimizer"] = ADAM_BYTES * shard / cluster.hbm_bw
    parts["total"] = sum(parts.values())
    return parts
