"""Expert shards (`parallel.expert` > 1) under the engine's other step features
(`pytest -k "moe_engine_steps"`; the topics' keys are in each name).

- DDP's expert all-reduce honours `communication_data_type`, `prescale_gradients` and
  `gradient_predivide_factor` as the dense buckets do: an expert shard and a dense twin given
  the same gradients get the same reduced gradient bit for bit, and the ledger's expert bytes
  are in the comm dtype (`-k expert_comm`).
- bf16 and fp16 (dynamic loss scale) at ZeRO 0, 1 and 3 with ep 2 stay within the format's
  tolerance (derived beside `TOLERANCE`) of ep 1 in the same format, and an inf in one rank's
  expert gradient skips the step on every rank (`-k mixed_precision`).
- A rank of an ep group that raised: after the step's last all-to-all the step is dropped on every
  rank and the run continues like one process (float64, rtol 1e-10); between two all-to-alls its
  peer gives up the all-to-all in bounded time and both stop naming it (`-k failed_step`).
- A DDP compression hook compresses the buckets only; the expert shards are averaged exactly
  (`-k compression`).
The default run takes one case of each (27 s alone on a loaded 2-core machine, of which ~15 s
start the world-2 and world-4 pools; the failed-step case closes the world-2 pool last);
`--thorough` runs both formats at every stage on dp 4 x ep 2 and the overflow at ZeRO 0 and 3.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.data_parallel import BucketedDDP
from tinyscale.dist import comm
from tinyscale.models import GPT, GPTConfig
from tinyscale.moe.parallel import ExpertShard
from tinyscale.testing import assert_every_rank_trained_like, run_on_ranks
from tinyscale.testing.pool import get_pool

# --- 1. the expert all-reduce in the comm dtype, pre- and post-divided as the buckets are

SHAPE = (3, 5)


class _Twins(nn.Module):
    """A dense parameter and an expert shard over the whole world (edp = dp, mean over dp): the
    same gradient into each, so DDP's bucket path and its expert path must agree exactly."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Parameter(torch.zeros(SHAPE, dtype=torch.float64))
        self.expert = nn.Parameter(torch.zeros(SHAPE, dtype=torch.float64))
        self.expert.expert_shard = ExpertShard(group=dist.group.WORLD, mean_over=dist.get_world_size(),
                                               experts=(0, 1), num_experts=1)

    def forward(self, x):
        return (self.dense * x).sum() + (self.expert * x).sum()


def _reduce_twins(comm_dtype, prescale: bool, factor: float):
    torch.manual_seed(11 + dist.get_rank())
    # float64 values that fp16 and bf16 round, some near fp16's largest (65504): their sum
    # overflows fp16 unless each rank divided by N first, as prescale_gradients does
    x = torch.randn(SHAPE, dtype=torch.float64) / 3
    x[0, :2] = 4.0e4 + dist.get_rank()
    ddp = BucketedDDP(_Twins())
    ddp.comm_dtype, ddp.prescale_gradients, ddp.gradient_predivide_factor = comm_dtype, prescale, factor
    with comm.record() as ledger:
        ddp(x).backward()
    rows = [r.bytes for r in ledger.rows if r.op == "all_reduce"]
    return ddp.module.dense.grad, ddp.module.expert.grad, rows


@pytest.mark.parametrize("comm_dtype", [None, torch.float16, torch.bfloat16], ids=["fp64", "fp16", "bf16"])
@pytest.mark.parametrize("prescale,factor", [(True, 1.0), (False, 1.0), (False, 3.0)],
                         ids=["prescale", "sum-then-divide", "predivide-3"])
def test_moe_engine_steps_expert_comm_follows_the_bucket_semantics(comm_dtype, prescale, factor):
    """World 4 (the predivide factor 3 divides nothing exactly): the expert shard's reduced gradient equals its dense
    twin's bit for bit on every rank, infs where fp16 overflows included, and the ledger's last
    all-reduce is the expert's, of 15 elements in the comm dtype."""
    out = run_on_ranks(_reduce_twins, 4, comm_dtype, prescale, factor)
    size = torch.finfo(comm_dtype or torch.float64).bits // 8
    for rank, (dense, expert, rows) in enumerate(out):
        assert torch.equal(dense, expert), (rank, dense - expert)
        assert rows[-1] == SHAPE[0] * SHAPE[1] * size, (rank, rows)
    dense = out[0][0]
    # not vacuous: fp16 overflows where the four ~4e4 terms are divided by less than 2.45 before
    # their sum (65504 is fp16's largest), and the formats round the float64 sum
    pre = 4 if prescale else factor
    assert bool(torch.isinf(dense).any()) == (comm_dtype is torch.float16 and 4 * 4.0e4 / pre > 65504)
    if comm_dtype is not None:
        exact = sum(_rank_grad(r) for r in range(4)) / 4
        assert not torch.equal(dense, exact)


def _rank_grad(rank: int) -> torch.Tensor:
    torch.manual_seed(11 + rank)
    x = torch.randn(SHAPE, dtype=torch.float64) / 3
    x[0, :2] = 4.0e4 + rank
    return x


# --- 2. bf16 and fp16 with ep > 1 against the same format at ep 1

VOCAB, SEQ, MICRO, M, STEPS = 33, 6, 2, 2, 3
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}
# SGD with momentum, not Adam (whose update hides a gradient off by a factor); every step clips.
SGD = {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9, "weight_decay": 0.01}}


def mp_model() -> GPT:
    """Tied, GQA, 4 experts in blocks 0 and 2 (top-2, a capacity that drops), fp32 masters."""
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=3, n_head=4, n_kv_head=2, d_model=8, ffn_hidden=12,
                    tie_embeddings=True, moe_experts=4, moe_top_k=2, moe_capacity_factor=0.8, moe_layers=(0, 2),
                    moe_aux_loss_coef=0.05, moe_z_loss_coef=0.01)
    return GPT(cfg, seed=5, dtype=torch.float32)


def mp_config(precision: str | None, ep: int, stage: int, dp: int, fp16: dict | None = None) -> dict:
    cfg = {"train_batch_size": MICRO * M * dp, "train_micro_batch_size_per_gpu": MICRO,
           "gradient_accumulation_steps": M, "optimizer": SGD, "gradient_clipping": 0.3,
           "zero_optimization": {"stage": stage}, "parallel": {"expert": ep}}
    return cfg | ({precision: {"enabled": True, **(fp16 or {})}} if precision else {})


def mp_batches(dp: int, steps: int = STEPS):
    return synthetic_token_batches(num_batches=steps, batch_size=MICRO * M * dp, seq_len=SEQ, vocab_size=VOCAB,
                                   seed=4)


def _train_mp(runs: list[tuple]):
    """On each rank, each (precision, ep, stage) trained STEPS steps: (losses, full state, skipped)."""
    dp, out = dist.get_world_size(), []
    for precision, ep, stage in runs:
        engine = ts.initialize(mp_model(), mp_config(precision, ep, stage, dp))
        losses = [engine.train_batch(b) for b in mp_batches(dp)]
        out.append((losses, {k: v.float() for k, v in engine.full_state_dict().items()}, engine.skipped_steps))
    return out


def distance(a: dict, b: dict) -> float:
    return sum(((a[k].float() - b[k].float()) ** 2).sum() for k in b).sqrt().item()


# The tolerance, derived as tests/engine/test_layout_mixed_precision.py derives it: ep adds no kind
# of error to training in a format, it reorders roundings the format makes anyway (an expert's
# weight gradient summed over the tokens of its ep group's ranks in one grouped matmul instead of
# per rank, the expert shards summed over edp, not dp). So ep 2 is as far from fp32 as ep 1 in the
# format is, D = |ep 1 in the format - ep 1 in fp32| (measured in the test, same model, batches,
# dp and stage), and by the triangle inequality within 2 D of ep 1 in the format. Losses: a scalar
# each, a mean over 24 tokens plus the aux losses, in fp32 from logits in the format; a reordered
# rounding moves it by at most u |loss| to first order. A router that flipped a token's expert
# would break both bounds (it moves the loss by ~1e-2, the parameters by a whole expert's update).
# Measured: see the test's docstring. A missed or doubled expert reduction, or a loss scale not divided out
# of the expert shards, moves the parameters by tens of percent of the update: >> 2 D.
TOLERANCE = 2.0


@functools.cache
def mp_results(world: int, runs: tuple) -> list:
    return run_on_ranks(_train_mp, world, [(None, 1, 0), *runs], timeout_s=300)


MP_CASES = [("bf16", 0), ("fp16", 1), ("bf16", 3), ("fp16", 0), ("bf16", 1), ("fp16", 3)]
# the default run: fp16 at ZeRO 1 on dp 2 x ep 2 (~15 s); --thorough: both formats at every stage
# on dp 4 x ep 2, whose edp pairs reduce (and ZeRO-shard) the expert shards (~3 min on 2 cores)
MP_PARAMS = [pytest.param(2, "fp16", 1, id="dp2xep2-fp16-zero1")] + [
    pytest.param(4, p, s, id=f"dp4xep2-{p}-zero{s}", marks=pytest.mark.thorough) for p, s in MP_CASES]


@pytest.mark.parametrize("world,precision,stage", MP_PARAMS)
def test_moe_engine_steps_mixed_precision_ep2_stays_within_the_format_tolerance_of_ep1(world, precision, stage):
    """dp `world` x ep 2 in bf16 / fp16 (dynamic loss scale) at ZeRO `stage`: losses within
    u |loss| and parameters within 2 D of dp `world` at ep 1 in the same format and stage (D derived
    above), the expert tensors and the rest each on their own (the experts' update is ~2% of the
    whole: a factor-2 error in the expert gradients moved the whole by 1.6 D only, the experts by 5.6 D).
    Measured (dp 4 x ep 2, every case): the experts 0.002-0.19 D from ep 1 (D: 14% of their update's
    norm in bf16, 1.8% in fp16), the rest 0.08-0.15 D (D: 1.2% in bf16, 0.14% in fp16), the losses
    <= 0.005 u; dp 2 x ep 2 fp16 ZeRO 1: experts 0.04 D, the rest bit for bit."""
    cases = [(precision, stage)] if world == 2 else MP_CASES
    runs = tuple((p, ep, s) for p, s in cases for ep in (1, 2))
    out = mp_results(world, runs)[0]  # full_state_dict and the losses are the same on every rank
    fp32 = out[0][1]
    (ep1_losses, ep1, ep1_skipped), (losses, ep2, skipped) = (out[1 + runs.index((precision, ep, stage))]
                                                                for ep in (1, 2))
    initial = {k: v.float() for k, v in mp_model().state_dict().items()}
    assert skipped == ep1_skipped == 0, "no step overflowed: every step is compared"
    for got, want in zip(losses, ep1_losses):
        assert abs(got - want) <= UNIT_ROUNDOFF[precision] * abs(want), (losses, ep1_losses)
    for experts in (True, False):  # the experts' update is ~2% of the whole: each part on its own
        part = functools.partial(_part, [k for k in initial if (".experts." in k) == experts])
        d_format = distance(part(ep1), part(fp32))
        assert d_format > 1e-4 * distance(part(fp32), part(initial)), "the format must round something"
        d_ep = distance(part(ep2), part(ep1))
        assert d_ep <= TOLERANCE * d_format, (experts, f"{d_ep:.3e} > {TOLERANCE} x {d_format:.3e}")


def _part(keys: list[str], state: dict) -> dict:
    return {k: state[k] for k in keys}


# --- 2b. fp16: an overflow in one rank's experts skips the step on every rank

def _overflow_in_rank1_experts(stage: int):
    """dp 2 x ep 2 (each expert on one rank only: its inf is never reduced to the other rank), fp16:
    step 0 puts an inf in rank 1's expert gradient; step 1 is clean."""
    engine = ts.initialize(mp_model(), mp_config("fp16", 2, stage, 2, fp16={"hysteresis": 1,
                                                                            "initial_scale_power": 12}))
    before, handle, scales = engine.full_state_dict(), None, []
    if dist.get_rank() == 1:
        param = dict(engine.model.named_parameters())["blocks.2.mlp.experts.w_down"]
        handle = param.register_hook(lambda g: torch.full_like(g, float("inf")))
    losses = []
    for step, batch in enumerate(mp_batches(2, steps=2)):
        losses.append(engine.train_batch(batch))
        scales.append(engine.loss_scaler.scale)
        if step == 0:
            if handle is not None:
                handle.remove()
            after_skip, skipped = engine.full_state_dict(), engine.skipped_steps
    return before, after_skip, engine.full_state_dict(), scales, skipped, engine.skipped_steps, losses


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.thorough), 1,
                                   pytest.param(3, marks=pytest.mark.thorough)])
def test_moe_engine_steps_mixed_precision_fp16_overflow_in_one_ranks_experts_skips_the_step_everywhere(stage):
    """Every rank skips step 0 (parameters unchanged, skipped_steps 1), backs the loss scale off
    together (hysteresis 1: 2^12 -> 2^11) and trains step 1 with the same loss."""
    results = run_on_ranks(_overflow_in_rank1_experts, 2, stage)
    for rank, (before, after_skip, after, scales, skipped, total, losses) in enumerate(results):
        assert skipped == 1 and total == 1, (rank, skipped, total)
        assert scales == [2.0**11, 2.0**11], (rank, scales)
        assert all(torch.equal(after_skip[k], v) for k, v in before.items()), (rank, "a rank stepped")
        assert not all(torch.equal(after[k], v) for k, v in before.items()), (rank, "step 1 must train")
        assert losses == results[0][-1], rank


# --- 4. a DDP compression hook with ep > 1: the buckets compressed, the expert shards not

def _one_step(compression: dict):
    """dp 4 x ep 2, float64, ZeRO 0, SGD (each parameter's update is its own gradient's): one step;
    the full state and this rank's bytes over its edp pair."""
    from tinyscale.moe import expert_group_ranks
    cfg = mp_config(None, 2, 0, 4) | {"optimizer": {"type": "SGD", "params": {"lr": 0.2}}, "gradient_clipping": 0.0,
                                      "compression": compression}
    engine = ts.initialize(GPT(mp_model().config, seed=5, dtype=torch.float64), cfg)
    engine.train_batch(mp_batches(4, steps=1)[0])
    edp = next(tuple(g) for g in expert_group_ranks(engine.mesh.layout, 2)[1] if dist.get_rank() in g)
    edp_bytes = sum(r.bytes for r in engine.comm_ledger.rows if r.op == "all_reduce" and r.ranks == edp)
    return engine.full_state_dict(), edp_bytes


def _compressed_and_not():
    return _one_step({"type": "topk", "ratio": 0.25}), _one_step({})


def test_moe_engine_steps_compression_hook_leaves_expert_shards_uncompressed():
    """As engine/expert.py documents: with a top-k hook (ratio 0.25) every expert tensor after one
    step equals the uncompressed run's bit for bit (their gradients were averaged over the edp pair
    exactly: 2 MoE layers x 3 tensors x 2 experts x 8 x 12 float64 elements sent whole), while the
    dense parameters differ (the hook did compress the buckets)."""
    for rank, ((topk, topk_bytes), (plain, plain_bytes)) in enumerate(run_on_ranks(_compressed_and_not, 4)):
        experts = [k for k in plain if ".experts." in k]
        assert all(torch.equal(topk[k], plain[k]) for k in experts), rank
        assert not all(torch.equal(topk[k], plain[k]) for k in plain if k not in experts), rank
        assert topk_bytes == plain_bytes == 2 * 3 * 2 * 8 * 12 * 8, (rank, topk_bytes, plain_bytes)


# --- 3. a step that raised on one rank of an ep group

BOUND_S = 10  # each train_batch: the agreement polls every 50 ms; 10 s leaves room for a loaded machine


def _f64_engine():
    return ts.initialize(GPT(mp_model().config, seed=5, dtype=torch.float64), mp_config(None, 2, 0, 2))


def _timed(engine, batch) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        engine.train_batch(batch)
        return "", "", time.monotonic() - start
    except Exception as exc:  # noqa: BLE001 - the test asserts which
        return type(exc).__name__, str(exc), time.monotonic() - start


def _failed_steps():
    """dp 2 x ep 2, float64. Late: rank 1's backward raises after the step's last all-to-all (at the
    embedding's output, last micro-batch of step 0); the batch is retried, then step 1.
    Mid: a fresh engine; rank 1 raises in block 1's forward (block 0's all-to-alls done, block
    2's not), where rank 0 waits for it in the all-to-all."""
    rank, data = dist.get_rank(), mp_batches(2, steps=2)
    engine, calls = _f64_engine(), []

    def throw(grad):
        raise MemoryError("simulated: rank 1's backward")
    def arm(module, args, out) -> None:  # returns None: the output stays as it is
        calls.append(1)
        if len(calls) == M:
            out.register_hook(throw)
    if rank == 1:
        engine.model.embed.register_forward_hook(arm)
    late = [_timed(engine, data[0])]
    losses = [engine.train_batch(b) for b in data]
    state = engine.full_state_dict()
    engine = _f64_engine()

    def boom(module, args):
        raise MemoryError("simulated: rank 1 mid-forward")
    if rank == 1:
        engine.model.blocks[1].register_forward_pre_hook(boom)
    return late, losses, state, _timed(engine, data[0])


def test_moe_engine_steps_failed_step_on_one_ep_rank_is_dropped_or_stops_every_rank_in_bounded_time():
    """A rank of an ep group that raised after the step's last all-to-all: every rank drops the
    step (rank 1 re-raises its error, rank 0 raises StepFailed naming it) and the retried run equals
    one process (float64, rtol 1e-10). One that raised between two all-to-alls: rank 0 gives up
    the all-to-all it waits in (the engine watches the ep group) and both ranks stop, naming rank 1,
    well within the bound (unwatched, rank 0 waited until the pool's deadline)."""
    model = GPT(mp_model().config, seed=5, dtype=torch.float64)
    flat = mp_config(None, 1, 0, 2) | {"parallel": {}, "gradient_accumulation_steps": M * 2}
    expected = ts.reference.train(model, mp_batches(2, steps=2), flat)
    try:
        results = run_on_ranks(_failed_steps, 2, timeout_s=60)
    finally:  # (last in this file: the pool's restart is paid once)
        get_pool(2).close()  # the mid-forward case leaves the ep group out of step: fresh ranks next time
    for rank, (late, losses, state, mid) in enumerate(results):
        for (name, message, seconds), what in ((late[0], "late"), (mid, "mid")):
            assert seconds < BOUND_S, (what, rank, seconds)
            assert name == ("MemoryError" if rank == 1 else "StepFailed"), (what, rank, name, message)
            assert rank == 1 or "[1]" in message, (what, message)
        assert rank == 1 or "cannot continue" in mid[1], mid
        assert_every_rank_trained_like([(losses, state)], expected, model.state_dict(), what=f"rank {rank}")
