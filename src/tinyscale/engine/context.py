"""Context parallelism in the engine: `parallel.context`, `context_algorithm`, `context_sharding`.

    {"parallel": {"context": 2, "context_algorithm": "ring", "context_sharding": "zigzag"}}

With ``parallel.context`` = cp the world is dp x cp ranks (mesh dims (pp, dp, cp, tp), so a
cp group is a run of consecutive ranks). What the engine does with it:

- rows: every rank of a cp group gets the same rows (the batch is split over dp only), and
  each micro-batch is cut along the sequence by `shard_micro_batch`
  (`tinyscale.context_parallel.shard_batch`: zigzag or contiguous, padded to the chunk count);
- model: `apply_context_parallel` over ``mesh.group("cp")`` (`engine/parallelize.py`, after
  tensor parallelism). Its loss is the full rows' mean on every cp rank; each rank's
  gradient is its own tokens' share, so the true gradient is their SUM over cp;
- gradients: DDP or ZeRO run over the flattened dp x cp group (`reduce_group`), which
  averages over dp*cp ranks; the engine multiplies each micro-batch's loss by cp before
  backward, so the result is the sum over cp and the mean over dp. ZeRO thus
  shards its states over dp*cp ranks (torchtitan's FSDP over ``dp_cp``): the cp ranks hold the
  same parameters and all of them need every parameter, so sharding over them saves memory at
  no extra traffic per gradient byte. The loss all-reduce runs over that group too: each of
  its dp*cp ranks reports the same mean for its rows, so sum / (dp*cp) is the global mean.

With tensor parallelism too (tp x cp, the mesh (dp, cp, tp)): TP splits the layers first, CP
then swaps attention and the forward, whose per-token loss becomes the vocab-parallel one
(the head holds a vocab slice); Ulysses then splits each TP shard's heads over cp. (The model's
forward without targets returns this rank's vocab slice of the logits.) With sequence
parallelism the cp shard of Tl positions is split again over tp outside the attention and the
MLP (each TP rank holds Tl/tp of them, gathered before a sub-layer, reduce-scattered after), so
Tl must be a multiple of tp: `shard_micro_batch` says so, by name, on every rank alike.

With a pipeline too (pp x cp, dp x pp x cp): `apply_to_stages` swaps the attention of this
rank's stages only and gives the last stage a loss that is the full rows' mean with a
backward of cp times its gradient (the executor both reports and backpropagates it), so the
reduction over dp x cp is the same as without a pipeline.

Activation checkpointing (the attention core's ring or all-to-all runs again in a rerun, on
every rank of the cp group alike) and ZeRO offload over dp x cp are served (`pytest -k
"layout_activation_checkpointing or layout_offload"`), and so are fp16/bf16 (`pytest -k
layout_mixed_precision`). Refused by name before any process group exists (`check_config`,
`check_layout`): dropout with stream masks (counter masks, GPTConfig.dropout_masks="counter", are
served: each rank hashes its tokens' and (query, key) blocks' masks from their global positions),
models other than the GPT, Ulysses with (heads per TP shard) % cp != 0, a world that is not
dp x cp x tp, and `context_algorithm` or `context_sharding` without `parallel.context` > 1 (they
would do nothing).
Lesson: lessons/09-context-parallel.md. Tests: `pytest -k engine_context_parallel`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tinyscale.config import ConfigError, EngineConfig
from tinyscale.context_parallel import apply_context_parallel, kv_replication, shard_batch
from tinyscale.context_parallel.sharding import Layout
from tinyscale.context_parallel.apply import (
    ContextParallel, parallelize_attention, sharded_mean_loss, token_cross_entropy,
)
from tinyscale.dist import ParallelMesh
from tinyscale.engine.plan import LayoutPlan
from tinyscale.engine.refusals import check_degree
from tinyscale.tensor_parallel import vocab_parallel_cross_entropy


def check_config(config: EngineConfig) -> list[str]:
    """What the config alone asks of context parallelism that cannot be served (no model needed)."""
    par, problems = config.parallel, []
    if par.context == 1:
        for name in ("context_algorithm", "context_sharding"):
            if name in par.model_fields_set:  # would silently do nothing
                problems.append(f"parallel.{name}={getattr(par, name)!r} needs parallel.context > 1 (it chooses how "
                                "context parallelism splits the sequence): set parallel.context, or remove it")
    return problems


def check_layout(config: EngineConfig, model: torch.nn.Module, world_size: int,
                 mesh: ParallelMesh | None = None) -> None:
    """Refuse a cp layout this model and world cannot take, naming the field and the fix (no collectives)."""
    par = config.parallel
    cp = par.context
    if not check_degree(model, mesh, axis="cp", field="parallel.context", degree=cp,
                        action="context parallelism splits tinyscale's GPT's sequence"):
        return
    gpt = model.config
    if gpt.dropout > 0 and gpt.dropout_masks == "stream":
        raise ConfigError(f"parallel.context={cp} with GPTConfig.dropout={gpt.dropout} and dropout_masks='stream': "
                          "a rank would need the stream's draws for the (query, key) pairs and tokens other ranks "
                          "hold; set GPTConfig.dropout_masks='counter' (masks hashed from global positions), or "
                          "dropout=0")
    if par.context_algorithm == "ulysses":  # over the heads of one tensor-parallel shard
        try:
            kv_replication(gpt.n_head // par.tensor, max(gpt.kv_heads // par.tensor, 1), cp)
        except ValueError as exc:
            where = f" (with parallel.tensor={par.tensor}: {gpt.n_head // par.tensor} heads per rank)" \
                if par.tensor > 1 else ""
            raise ConfigError(f"parallel.context={cp} with parallel.context_algorithm=\"ulysses\"{where}: "
                              f"{exc}") from None
    per_dp = par.tensor * par.pipeline * cp
    if world_size % per_dp != 0:
        raise ConfigError(f"parallel.context={cp} (x tensor {par.tensor} x pipeline {par.pipeline}) does not divide "
                          f"the world size {world_size}: the ranks are dp x cp; choose parallel.context among "
                          f"{[d for d in range(1, world_size + 1) if world_size % (d * par.tensor * par.pipeline) == 0]}")


# --8<-- [start:reduce-group]
def reduce_group(mesh: ParallelMesh | None) -> tuple[object, int, int]:
    """(group, rank in it, size) of the gradient reduction: dp x cp flattened (dp when cp = 1).
    DDP and ZeRO average over it, so the engine multiplies each loss by cp before backward:
    the mean over dp*cp ranks of cp x (each rank's share) = the sum over cp, the mean over dp."""
    if mesh is None:
        return None, 0, 1
    return mesh.group("dp", "cp"), mesh.rank("dp", "cp"), mesh.size("dp", "cp")
# --8<-- [end:reduce-group]


def _token_losses(model: torch.nn.Module, plan: LayoutPlan, mesh: ParallelMesh):
    """Per-token losses of the head's output: cross-entropy, or with tensor parallelism (the
    head holds a vocab slice) Megatron's loss over the TP group, never gathered."""
    if plan.tp == 1:
        return token_cross_entropy
    group, vocab = mesh.group("tp"), model.config.vocab_size

    def losses(local_logits, targets):  # (B, Tl, Vp/tp), (B, Tl) -> (B, Tl)
        local_logits = local_logits.to(torch.promote_types(local_logits.dtype, torch.float32))
        return vocab_parallel_cross_entropy(local_logits.flatten(0, 1), targets.flatten().long(), group,
                                            vocab_size=vocab).view_as(targets)
    return losses


def apply(model: torch.nn.Module, plan: LayoutPlan, mesh: ParallelMesh | None) -> None:
    """Context parallelism over the mesh's cp axis, in place (nothing when cp = 1)."""
    if plan.cp == 1:
        return
    apply_context_parallel(model, mesh.group("cp"), algorithm=plan.context_algorithm,
                           sharding=plan.context_sharding, token_losses=_token_losses(model, plan, mesh))


# --8<-- [start:stages]
def apply_to_stages(stages: dict, model: torch.nn.Module, plan: LayoutPlan, mesh: ParallelMesh):
    """pp x cp: this rank's pipeline stages (`GPTStage`s) run on their sequence shard, in place;
    returns the last stage's loss_fn. Each stage's attention becomes ring or Ulysses over the cp
    axis and reads RoPE at the shard's global positions; the loss is the full rows' mean (the
    same on every cp rank) with a backward of cp times its gradient, so that DDP's or ZeRO's
    mean over dp x cp sums over cp (`reduce_group`)."""
    group = mesh.group("cp")
    losses = _token_losses(model, plan, mesh)
    state = ContextParallel(group, plan.context_algorithm, plan.context_sharding, losses)
    rank, last = mesh.rank("cp"), model.config.max_seq_len - 1

    def positions(local_len: int) -> torch.Tensor:  # padded positions past the table reach no real token
        return state.layout(local_len).positions(rank).clamp(max=last)
    for stage in stages.values():
        parallelize_attention(stage.blocks, state)
        stage.positions = positions

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # (B, Tl, V or Vp/tp), (B, Tl)
        return _ScaleGrad.apply(sharded_mean_loss(state, logits, targets), float(state.cp))
    return loss_fn
# --8<-- [end:stages]


class _ScaleGrad(torch.autograd.Function):
    """Forward: identity. Backward: the gradient times `scale` (the engine's x cp, applied to a
    pipeline's loss, which the executor both reports and backpropagates)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def shard_micro_batch(chunk: tuple[torch.Tensor, ...], model: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """This rank's sequence shard of a micro-batch (inputs, targets), each (b, T) -> (b, Tl)
    (the chunk itself unless `apply` made the model context-parallel)."""
    state = getattr(model, "context_parallel", None)
    if state is None:
        return chunk
    if len(chunk) != 2:
        raise ValueError(f"train_batch with parallel.context={state.cp}: a batch is (inputs, targets), "
                         f"got {len(chunk)} tensors")
    # Checked on the whole rows, which every rank of the cp group holds, so they all raise together:
    # a bad id in one rank's shard alone would leave its peers waiting in the ring (or all-to-all).
    vocab = model.config.vocab_size
    for name, ids in zip(("inputs", "targets"), chunk):
        bad = (ids < 0) | (ids >= vocab)  # (b, T)
        if bad.any():
            raise ValueError(f"train_batch: {name} has token ids outside 0..{vocab - 1} (first [row, position] "
                             f"pairs: {bad.nonzero().tolist()[:4]}): fix the data or GPTConfig.vocab_size")
    tp_group = getattr(model, "tp_group", None)
    if getattr(model, "sequence_parallel", False):  # SP splits each cp shard again, over tp
        tp, layout = dist.get_world_size(tp_group), Layout(state.cp, state.sharding, chunk[0].shape[1])
        if layout.local_len % tp:  # the same T on every rank: they all raise, before any collective
            raise ValueError(f"train_batch: a sequence of T={chunk[0].shape[1]} tokens cut into "
                             f"{layout.num_chunks} {state.sharding} chunks gives each of the cp={state.cp} ranks "
                             f"{layout.local_len} positions, which sequence parallelism cannot split over "
                             f"tp={tp}; use a T for which ceil(T / {layout.num_chunks}) x {layout.num_chunks // state.cp}"
                             f" is a multiple of {tp} (e.g. T = {layout.num_chunks * tp}k), or sequence_parallel false")
    return shard_batch(chunk, state.group, state.sharding)
