"""The `compression` section in the engine: which hook or optimizer, and what it composes with.

    "compression": {"type": "powersgd", "rank": 2}

topk, randomk, qsgd and powersgd replace the all-reduce of each `BucketedDDP` bucket with
a communication hook (`tinyscale.compression`); onebit_adam replaces the optimizer, which
then does the data-parallel communication itself (no DDP wrapper: in its warm-up it
all-reduces the gradients, after it the 1-bit momentum).

Compression acts on the dp axis only, in every layout (issue 25). The reduce group is the
engine's: dp, or dp x cp flattened with context parallelism. What each layout adds:
- tensor parallelism: each TP rank compresses its own shards' gradients over its dp group
  (the DDP of its TP shard). A replicated parameter (norm weights, a row-parallel bias, a K/V
  head copied on t/K ranks) has the same gradient on its copies before the hook, but its
  compressed mean depends on the rest of the bucket (top-k's selection, QSGD's scale, 1-bit
  Adam's chunks), so copies would drift apart: `agree_replicas` gives every copy its owner's
  (the copy the clipping norm counts), one all-reduce over tp of the replicated parameters;
- pipeline parallelism: the hooks run when the step syncs DDP once after the schedule; a tied
  embedding's two stages exchange their gradients after that sync, so each stage compresses its
  own part and both copies step on the same sum (1-bit Adam: the first stage's momentum wins);
- context parallelism: cp ranks hold different partial gradients (each its tokens' share,
  scaled by cp so that the dp x cp mean sums over cp): each rank compresses its own scaled
  share, and the result is the mean over dp x cp of the compressed shares, an estimate of the
  same gradient with dp x cp payloads summed instead of dp (error feedback keeps each
  share's residual).
Lossless settings (ratio 1, PowerSGD at full rank) equal the uncompressed engine in every
layout, float64 (tests/engine/test_layout_compression.py, `pytest -k layout_compression`).

What is refused, and why (before any process group exists):
- ZeRO stages 1-3: they reduce-scatter gradients into shards (or all-gather parameters); a
  compressed payload is not a sum that can be scattered (top-k's indices differ per rank,
  PowerSGD's P and Q are not gradients). Compression here is for data parallelism (stage 0).
- fp16: its overflow check reads the averaged gradient after the reduction, but a hook
  compresses each rank's scaled gradient during backward: an inf on one rank enters every
  rank's sum and the compressor's state (error-feedback residuals, PowerSGD's memories, 1-bit
  Adam's errors) before any rank can know to skip the step (random-k may not even send it, and
  keep it in the residual for ever). Serving it needs the overflow flag agreed over the world
  before the first bucket is sent (no overlap) and every state put back on a skip.
- bf16: error feedback would keep its residuals in bf16, whose 8-bit mantissa rounds away a
  residual below 1/256 of the gradient it is added to: what was not sent is lost, not delayed
  (the residuals would have to live in fp32, as the masters do).
- onebit_adam with fp16 or bf16: both replace the optimizer (1-bit Adam steps what it is given
  and communicates; mixed precision steps fp32 masters), so the engine asks for 1-bit Adam
  first and refuses the pair by name rather than let one stand in for the other.
- onebit_adam with gradient clipping (after the warm-up no rank holds the averaged gradient
  to take a norm of) or with an optimizer other than Adam/AdamW. Gradient accumulation is
  fine: gradients accumulate locally, as under DDP's no_sync, and the optimizer step
  communicates once.
- powersgd with start_iter 1: its per-bucket memories need one plain step first (torch
  refuses the same).

A step dropped after its hooks ran gets the hook's state put back (`snapshot`, `restore`); a
checkpoint holds every rank's compression state (`local_state`) and resumes it on as many ranks.

Lesson: lessons/10-compression.md. Tests: `pytest -k compression_engine`, `pytest -k compression_user`,
`pytest -k layout_compression`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tinyscale.compression import (
    QSGD, CompressionState, OneBitAdam, PowerSGDState, RandomK, TopK, compression_hook, powersgd_hook,
)
from tinyscale.config import ConfigError, EngineConfig
from tinyscale.dist import comm
from tinyscale.engine.checkpoint import CheckpointError
from tinyscale.engine.plan import tp_placement


def check_config(config: EngineConfig) -> list[str]:
    """What this config asks of compression that the engine cannot serve (no model needed)."""
    c, problems = config.compression, []
    if c.type == "none":
        return problems
    stage = config.zero_optimization.stage
    if stage > 0:
        problems.append(f"compression.type={c.type!r} with zero_optimization.stage={stage}: ZeRO reduce-scatters "
                        "gradients into shards and a compressed payload is not a sum that can be scattered; use "
                        "stage 0 (data parallelism) with compression, or compression.type \"none\"")
    why = {"fp16": "the hook compresses each rank's scaled fp16 gradient during backward, so an overflow on one "
                   "rank reaches every rank's sum and the compressor's state (residuals, PowerSGD's memories) "
                   "before the loss scaler can skip the step",
           "bf16": "error feedback would keep its residuals in bf16, whose 8-bit mantissa rounds away a residual "
                   "below 1/256 of the gradient it is added to: what was not sent is lost, not delayed"}
    problems += onebit_mixed_precision(config)
    for section in ("fp16", "bf16"):
        if getattr(config, section).enabled and c.type != "onebit_adam":
            problems.append(f"compression.type={c.type!r} with {section}.enabled: {why[section]}; use float32 "
                            f"parameters with compression, or compression.type \"none\" with {section}")
    if c.type == "powersgd" and c.start_iter < 2:
        problems.append(f"compression.start_iter={c.start_iter} with type \"powersgd\": error feedback and warm "
                        "start need at least one plain all-reduce step first; set start_iter >= 2")
    if c.type == "onebit_adam":
        if config.optimizer.type not in ("Adam", "AdamW"):
            problems.append(f"compression.type=\"onebit_adam\" replaces the optimizer: optimizer.type is "
                            f"{config.optimizer.type!r}; set optimizer.type \"AdamW\" (its params are used)")
        if config.gradient_clipping > 0:
            problems.append("compression.type=\"onebit_adam\" with gradient_clipping: after the warm-up no rank "
                            "holds the averaged gradient to take a norm of; set gradient_clipping 0")
    return problems


def onebit_mixed_precision(config: EngineConfig) -> list[str]:
    """onebit_adam with fp16 or bf16, refused by name: both replace the optimizer (Engine.__init__)."""
    if config.compression.type != "onebit_adam":
        return []
    return [f"compression.type=\"onebit_adam\" with {s}.enabled: both replace the optimizer (1-bit Adam steps the "
            f"parameters it is given and communicates itself; {s} steps fp32 masters with MixedPrecisionOptimizer), "
            "so one would silently stand in for the other; composing them means 1-bit Adam stepping the masters and "
            "agreeing its momentum on them; use float32 parameters with onebit_adam, or compression.type \"none\" "
            f"with {s}" for s in ("fp16", "bf16") if getattr(config, s).enabled]


def owns_communication(config: EngineConfig) -> bool:
    """True when the optimizer does the data-parallel communication (no DDP wrapper)."""
    return config.compression.type == "onebit_adam"


def optimizer(groups, config: EngineConfig, group, model=None, pipeline=None) -> torch.optim.Optimizer:
    """1-bit Adam over `groups` with the config's optimizer params (AdamW's decoupled decay); its
    averaged momentum made to agree on TP copies and a pipeline's tied table (`agreement`)."""
    if problems := onebit_mixed_precision(config):  # the engine asks for 1-bit Adam first: refused, not replaced
        raise ConfigError("\n  ".join(problems))
    p = config.optimizer.params
    opt = OneBitAdam(groups, lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay,
                     freeze_step=config.compression.freeze_step, group=group)
    opt.agree = None if model is None else agreement(model, pipeline)
    return opt


# --8<-- [start:agree]
def replica_owners(model, tp_group) -> dict[int, tuple[int, int, bool]]:
    """id of each TP-replicated parameter -> (row, rows, owner): its copies hold one of `rows`
    different tensors (a K/V head of K; else 1), this one is number `row`, and `owner` says this
    rank's copy is the one counted (its placement's `tp_counted`: TP rank 0, or a head's first copy)."""
    owners = {}
    for module in model.modules():
        for q in module.parameters(recurse=False):
            if not q.requires_grad:
                continue
            shape = tuple(q.shape)
            place = tp_placement(module, q, shape, shape, tp_group)  # engine/plan.py: split, replicated or a copy
            if place["tp"] == "shard":
                continue  # split: each rank's shard is its own
            row, rows = (module.head, module.n_kv_head) if place["tp"] == "kv_copy" else (0, 1)
            owners[id(q)] = (row, rows, place["tp_counted"])
    return owners


@torch.no_grad()
def agree_replicas(params, tensors, owners: dict, tp_group) -> None:
    """Each TP-replicated parameter's tensor in `tensors` (its compressed mean gradient, or 1-bit
    Adam's averaged momentum) set to its owner's copy on every rank holding one: one all-reduce
    over tp of (rows, numel) per parameter, zero but for the owner's row."""
    slots = [(t, *owners[id(q)]) for q, t in zip(params, tensors) if t is not None and id(q) in owners]
    if not slots:
        return
    flat = torch.cat([t.new_zeros(rows * t.numel()) for t, _, rows, _ in slots])  # (sum rows numel,)
    start, views = 0, []
    for t, row, rows, owner in slots:
        view = flat[start:start + rows * t.numel()].view(rows, -1)  # (rows, numel)
        if owner:
            view[row].copy_(t.reshape(-1))
        views.append(view[row])
        start += rows * t.numel()
    comm.all_reduce(flat, group=tp_group)
    for (t, *_), view in zip(slots, views):
        t.copy_(view.view_as(t))
# --8<-- [end:agree]


def agreement(model, pipeline=None):
    """`agree(params, tensors)` for what the compressed averages leave different on copies of one
    parameter: TP-replicated ones (`agree_replicas`) and, under 1-bit Adam with a pipeline, the
    tied table's two stages (the first stage's copy); None when the layout has no copies."""
    tp_group = pipeline.tp_group if pipeline is not None else getattr(model, "tp_group", None)
    tied = pipeline.tied if pipeline is not None else None
    if tp_group is None and tied is None:
        return None
    owners = replica_owners(model, tp_group) if tp_group is not None else {}

    @torch.no_grad()
    def agree(params, tensors) -> None:
        if tp_group is not None:
            agree_replicas(params, tensors, owners, tp_group)
        mine = None if tied is None else next((t for q, t in zip(params, tensors) if q is tied[0]), None)
        if mine is not None:  # None on both stages alike: a frozen table is not stepped
            peer = tied[1]
            theirs = torch.empty_like(mine)
            for work in comm.batch_isend_irecv([comm.P2POp("isend", mine.contiguous(), peer, pipeline.group),
                                                comm.P2POp("irecv", theirs, peer, pipeline.group)]):
                work.wait()
            if dist.get_rank() > peer:  # the first stage's ranks are the lower: its copy wins
                mine.copy_(theirs)
    return agree


def after_sync(engine, tp_group) -> None:
    """After a compressing hook's DDP sync: TP copies of a replicated parameter get their owner's
    compressed mean (`agree_replicas`). Nothing without a hook or tensor parallelism."""
    if tp_group is None or _hook_state(engine.ddp) is None:
        return
    owners = replica_owners(engine.model, tp_group)  # a walk over the modules, no communication
    agree_replicas(engine.params, [q.grad for q in engine.params], owners, tp_group)


# --8<-- [start:attach]
def attach(ddp, config: EngineConfig, group) -> None:
    """Register the configured compression hook on the engine's `BucketedDDP`."""
    c = config.compression
    if c.type == "powersgd":
        state = PowerSGDState(group, matrix_approximation_rank=c.rank, start_powerSGD_iter=c.start_iter,
                              min_compression_rate=c.min_compression_rate, use_error_feedback=c.error_feedback,
                              random_seed=c.seed)
        ddp.register_comm_hook(state, powersgd_hook)
    elif c.type in ("topk", "randomk", "qsgd"):
        compressor = {"topk": lambda: TopK(c.ratio), "randomk": lambda: RandomK(c.ratio, seed=c.seed),
                      "qsgd": lambda: QSGD(c.bits, seed=c.seed, norm=c.norm)}[c.type]()
        ddp.register_comm_hook(CompressionState(compressor, group, error_feedback=c.error_feedback), compression_hook)
# --8<-- [end:attach]


def _hook_state(ddp):
    hook = getattr(ddp, "_comm_hook", None)
    return hook[0] if hook is not None and isinstance(hook[0], (CompressionState, PowerSGDState)) else None


def snapshot(ddp):
    """The hook's state before a step (None without one): a step that is dropped has run the
    hooks (every rank completes the buckets' communication), so it must be put back."""
    state = _hook_state(ddp)
    return None if state is None else state.state_dict()


def restore(ddp, saved) -> None:
    """Put back what `snapshot` took."""
    if saved is not None:
        _hook_state(ddp).load_state_dict(saved)


def keep_unsent(ddp, saved) -> None:
    """Error feedback: a parameter no rank used this step gets no gradient (DDP drops its
    average), so what the hook sent of its residual would be lost: it keeps the residual it had
    (PowerSGD: its slice of the bucket's error)."""
    state = _hook_state(ddp)
    if isinstance(state, PowerSGDState) and state.use_error_feedback:  # errors per bucket: their slices
        for b, bucket in enumerate(ddp.buckets):
            if b not in state.errors or state.errors[b] is saved["errors"].get(b):
                continue  # no memory yet, or not compressed this step
            old = saved["errors"].get(b)
            for i, p in enumerate(bucket.params):
                if p.grad is None:
                    where = slice(bucket.offsets[i], bucket.offsets[i] + p.numel())
                    state.errors[b][where] = 0 if old is None else old[where]
        return
    if not isinstance(state, CompressionState) or state.feedback is None:
        return
    for p in ddp.params:
        if p.grad is None and p in saved["residuals"]:
            state.residuals[p] = saved["residuals"][p]
        elif p.grad is None:
            state.residuals.pop(p, None)


def local_state(engine) -> dict | None:
    """This rank's compression state for a checkpoint (residuals by parameter name), or None.
    Per rank: each rank's residuals and errors differ, so rank 0 saves every rank's."""
    names = {p: n for n, p in engine.model.named_parameters()}
    if isinstance(engine.optimizer, OneBitAdam):
        return {"type": "onebit_adam", "state": engine.optimizer.comm_state()}
    state = snapshot(engine.ddp)
    if state is None:
        return None
    if "residuals" in state:
        state["residuals"] = {names[p]: r.clone() for p, r in state["residuals"].items()}
    return {"type": engine.config.compression.type, "state": state}


def check_resume(saved_world: int, world: int, saved_ranks: dict) -> None:
    """Refuse a resume on another world size when the checkpoint holds compression state
    (residuals and errors are per rank, 1-bit Adam's server error per rank's chunk)."""
    if saved_world != world and any(s.get("compression") for s in saved_ranks.values()):
        raise CheckpointError(f"load_checkpoint: the checkpoint holds per-rank compression state (residuals, "
                              f"errors) of {saved_world} ranks and is loaded on {world}: resume on {saved_world} "
                              "ranks, or load it into an engine with compression.type \"none\"")


def load_local_state(engine, saved: dict | None) -> None:
    """Set this rank's compression state from `local_state`'s (None: the checkpoint has none,
    as from a run without compression: start it fresh)."""
    if saved is None or saved["type"] != engine.config.compression.type:
        return  # none saved, or another compressor's: this one starts fresh
    device, state = engine.device, dict(saved["state"])
    if isinstance(engine.optimizer, OneBitAdam):
        engine.optimizer.load_comm_state({k: v.to(device) if isinstance(v, torch.Tensor) else v
                                          for k, v in state.items()})
        return
    if "residuals" in state:
        params = dict(engine.model.named_parameters())
        state["residuals"] = {params[n]: r.to(device) for n, r in state["residuals"].items()}
    if "errors" in state:  # PowerSGD's memories (its seed stream stays on the CPU)
        sizes = [b.offsets[-1] + b.params[-1].numel() for b in engine.ddp.buckets]
        if any(i >= len(sizes) or e.numel() != sizes[i] for i, e in state["errors"].items()):
            raise CheckpointError("load_checkpoint: PowerSGD's memories are per bucket, and this engine's buckets "
                                  "differ from the checkpoint's: resume with the zero_optimization.reduce_bucket_size "
                                  "(and model) it was saved with")
        state["errors"] = {i: e.to(device) for i, e in state["errors"].items()}
        state["qs"] = {i: [q.to(device) for q in qs] for i, qs in state["qs"].items()}
    restore(engine.ddp, state)
