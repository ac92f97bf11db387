"""fp16 and bf16 in every layout (`pytest -k layout_mixed_precision`).

- `tinyscale.reference.train` with fp16/bf16 is the engine in one process, bit for bit;
- tp (with and without sequence parallelism), cp (ring and Ulysses), pp (AFAB, 1F1B,
  interleaved, zero-bubble; ZeRO 1 over dp), tp x cp, dp x tp at ZeRO 0-3 and pp x tp, in
  bf16 and in fp16 (dynamic loss scale): losses, parameters and the norm clipping uses (the
  whole model's, each parameter once, the same on every rank) stay within the format's
  tolerance of one process in the same format (derived below, beside `TOLERANCE`), with tied
  embeddings, GQA (a K/V head copied over tp), a vocab and a layer count the degrees do not
  divide, momentum, weight decay, accumulation and clipping on; stage-0 masters are exactly
  this rank's pieces;
- a pipeline changes no arithmetic: pp 2 in bf16 equals one process, and pp 2 x tp 2 equals
  tp 2, bit for bit (untied, no clipping: the only sums a pipeline reorders);
- a checkpoint holds every master whole under the original names and resumes bit for bit;
- an inf in one gradient on one rank (one tp rank of one pipeline stage; one rank of tp 2 x cp
  2 at ZeRO 1; tp 2; cp 2; dp 2 x pp 2 at ZeRO 1) skips the step on every rank: parameters
  unchanged everywhere, the same skipped_steps, the loss scale backed off on every rank.
The default run takes a representative subset; `--thorough` runs every layout in both formats.
Run: `pytest tests/engine/test_layout_mixed_precision.py` (key layout_mixed_precision).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.engine.monitor import grad_norm_of
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import run_on_ranks

VOCAB, SEQ, MICRO, M, STEPS = 37, 8, 2, 2, 3
# tied, GQA (4 query heads, 1 K/V head: copied on both tp ranks), a vocab tp = 2 does not divide,
# 5 layers pp = 2 does not; linear biases (fp16/bf16 parameters with fp32 masters like the weights).
# Tiny shapes: fp16 matmuls run at ~1 GFLOP/s on this CPU.
GPT_CONFIG = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=5, n_head=4, n_kv_head=1, d_model=16,
                       ffn_hidden=24, tie_embeddings=True, bias=True)
# SGD, not Adam: Adam divides by the gradient's own size, so it would hide a gradient off by a
# factor (a clipping norm counted on one stage only, a loss scale not divided out). The
# gradient norm here is ~1: every step clips.
SGD = {"type": "SGD", "params": {"lr": 0.2, "momentum": 0.9, "weight_decay": 0.01}}
CLIP = 0.3
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}  # 8 and 11 significant bits, round to nearest

# (name, parallel section and engine keys): the world is dp x the degrees (dp 2 where it says so)
WORLD2 = [
    ("pp2_afab", {"pipeline": 2, "pipeline_schedule": "afab"}),
    ("pp2_zero_bubble", {"pipeline": 2, "pipeline_schedule": "zb_h1"}),
    ("tp2", {"tensor": 2}),
    ("tp2_sp", {"tensor": 2, "sequence_parallel": True}),
    ("cp2_ring", {"context": 2}),
    ("cp2_ulysses", {"context": 2, "context_algorithm": "ulysses"}),
    ("pp2_1f1b", {"pipeline": 2, "pipeline_schedule": "1f1b"}),
    ("pp2_interleaved", {"pipeline": 2, "pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2}),
    ("pp2_zero1", {"pipeline": 2, "stage": 1}),  # ZeRO 1 over dp 1, clipping by the norm over the stages
]
WORLD4 = [
    ("tp2_cp2", {"tensor": 2, "context": 2}),
    ("dp2_tp2_zero0", {"tensor": 2}),
    ("dp2_tp2_zero1", {"tensor": 2, "stage": 1}),
    ("dp2_tp2_zero2", {"tensor": 2, "stage": 2}),
    ("dp2_tp2_zero3", {"tensor": 2, "stage": 3}),
    ("pp2_tp2", {"pipeline": 2, "tensor": 2}),
    ("dp2_pp2_zero1", {"pipeline": 2, "stage": 1}),
    ("dp2_pp2_zero2", {"pipeline": 2, "stage": 2}),  # one reduce-scatter after the schedule
    ("dp2_pp2_zero3", {"pipeline": 2, "stage": 3, "pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2}),
]
DEFAULT = {"tp2_sp", "cp2_ring", "pp2_interleaved", "tp2_cp2", "dp2_tp2_zero1", "pp2_tp2", "dp2_pp2_zero3"}


def model(tied: bool = True) -> GPT:
    return GPT(GPT_CONFIG.with_(tie_embeddings=tied), seed=11, dtype=torch.float32)  # fp32: the masters' values


def degrees(layout: dict) -> int:
    return layout.get("tensor", 1) * layout.get("context", 1) * layout.get("pipeline", 1)


def config(precision: str | None, dp: int = 1, layout: dict | None = None, fp16: dict | None = None) -> dict:
    parallel = dict(layout or {})
    stage, clip = parallel.pop("stage", 0), parallel.pop("clip", CLIP)
    cfg = {"train_batch_size": MICRO * M * dp, "train_micro_batch_size_per_gpu": MICRO,
           "gradient_accumulation_steps": M, "optimizer": SGD, "gradient_clipping": clip,
           "zero_optimization": {"stage": stage}, "parallel": parallel}
    if precision is not None:
        cfg[precision] = {"enabled": True, **(fp16 or {})}
    return cfg


def batches(dp: int, steps: int = STEPS):
    return synthetic_token_batches(num_batches=steps, batch_size=MICRO * M * dp, seq_len=SEQ, vocab_size=VOCAB,
                                   seed=4)


@contextlib.contextmanager
def one_thread():
    """This process's runs are tiny: one thread (on a busy 2-core machine a second one mostly spin-waits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.cache
def reference(precision: str | None, dp: int, clip: float = CLIP, tied: bool = True):
    """One process, a layout's batch (dp) and clipping, no parallel keys (cached: the layouts share it)."""
    net = model(tied)
    cfg = config(precision, dp, {"clip": clip})
    with one_thread():
        losses = ts.reference.train(net, batches(dp), cfg | {"parallel": {}, "zero_optimization": {"stage": 0}})
    return losses, {k: v.float() for k, v in net.state_dict().items()}


def _train(layouts: list[tuple[str, dict]], precision: str, tied: bool = True):
    """On each rank: every layout trained STEPS steps; (losses, full state on rank 0, skipped steps)."""
    out = []
    for _, layout in layouts:
        dp = dist.get_world_size() // degrees(layout)
        engine = ts.initialize(model(tied), config(precision, dp, layout))
        if engine.zero is None:  # fp32 masters of exactly this rank's pieces (TP shards, stages): 4 bytes to 2
            report = engine.memory_report()
            assert report.bytes("master_weights") == 2 * report.bytes("parameters") > 0
        losses = [engine.train_batch(batches(dp)[0])]
        # the clipping norm of step 0, in every layout (ZeRO's too): every step clips, so a gradient off
        # by a factor (averaged twice over dp, or not at all; a loss scale left in) shows only here
        norm = grad_norm_of(engine)
        losses += [engine.train_batch(b) for b in batches(dp)[1:]]
        _check_masters(engine, precision)
        state = engine.full_state_dict()
        out.append((losses, state if dist.get_rank() == 0 else None, engine.skipped_steps, norm))
    return out


def _check_masters(engine, precision: str) -> None:
    """The step updates fp32 masters, and the parameters are those masters rounded: exact checks (a
    step on the rounded weights moves the parameters by only ~1.2 D in bf16 and ~1.6 D in fp16, within
    the statistical tolerance below, measured 2026-11-27)."""
    low = torch.float16 if precision == "fp16" else torch.bfloat16
    masters = engine.optimizer.masters if engine.zero is None else engine.zero.sharded.master
    assert all(m.dtype == torch.float32 for m in masters)
    # after 3 steps some master holds bits the format cannot (rounded masters hold none)
    assert any((m != m.to(low).float()).any() for m in masters), "the masters are rounded to the format"
    if engine.zero is None:  # this rank's parameters are its masters rounded (ZeRO: shards, gathered)
        assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(engine.optimizer.params, masters)), \
            "the parameters are not the masters rounded"


@functools.cache
def one_process_norm(precision: str, dp: int) -> float:
    """The gradient norm step 0 clips by, in one process in the format (the dp ranks' rows as
    dp x M micro-batches: the same mean gradient)."""
    cfg = config(precision, 1) | {"train_batch_size": MICRO * M * dp, "gradient_accumulation_steps": M * dp}
    engine = ts.initialize(model(), cfg)
    with one_thread():
        engine.train_batch(batches(dp)[0])
    return engine.optimizer.last_grad_norm


def distance(a: dict, b: dict) -> float:
    return sum(((a[k].float() - b[k].float()) ** 2).sum() for k in b).sqrt().item()


def test_layout_mixed_precision_reference_is_the_engine_in_one_process_bit_for_bit():
    """The truth the layouts are compared with: `reference.train` honours fp16/bf16 (fp32 masters,
    fp16's scaled backward, clipping the unscaled gradient) exactly as the engine does."""
    for precision in ("bf16", "fp16"):
        losses, state = reference(precision, 1)
        engine = ts.initialize(model(), config(precision))
        with one_thread():
            assert [engine.train_batch(b) for b in batches(1)] == losses, precision
        full = engine.full_state_dict()
        assert all(torch.equal(full[k].float(), v) for k, v in state.items()), precision
        assert {v.dtype for v in full.values() if v.is_floating_point()} >= {torch.float16 if precision == "fp16"
                                                                            else torch.bfloat16}


def test_layout_mixed_precision_reference_skips_an_overflow_as_the_engine_does():
    """fp16 in one process with an inf in step 1's gradient and a warm-up schedule: the reference
    and the engine skip the same step, back off alike, and do not advance the schedule."""
    cfg = config("fp16", fp16={"hysteresis": 1}) | {
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 0.2}}}
    data = batches(1)
    data.insert(1, data[1])  # the overflowing step is retried on the same batch

    def inject(net):  # an inf in one gradient, in the first backward of step 1 only
        calls = []
        return net.blocks[2].attn.wo.weight.register_hook(
            lambda g: calls.append(1) or (torch.full_like(g, float("inf")) if len(calls) == M + 1 else g))

    net = model()
    with one_thread():
        handle = inject(net)
        losses = ts.reference.train(net, data, cfg)
        handle.remove()
        engine = ts.initialize(model(), cfg)
        handle = inject(engine.model)
        engine_losses = [engine.train_batch(b) for b in data]
    assert engine.skipped_steps == 1 and engine.loss_scaler.scale == 2.0**15
    assert engine_losses == losses
    full = engine.full_state_dict()
    assert all(torch.equal(full[k], v) for k, v in net.state_dict().items())


# The tolerance, derived. A layout does not add a kind of error to training in a format: it
# reorders roundings the format makes anyway (TP's partial sums rounded before their all-reduce,
# CP's attention merged from blocks, the dp mean of the gradients, the tied table's two halves
# summed after accumulation, a norm summed over stages). So a layout's run is as far from the
# fp32 run as one process's run in the format is, D = |one process in the format - one process
# in fp32| (measured in the test, on the same model and batches), and by the triangle inequality
# within 2 D of one process in the format. Parameters: the norm of the difference over every
# tensor (some 8k elements: a stable statistic). Measured 2026-11-27, 3 steps, every layout
# (--thorough): D is 2.33-2.46% of the update's norm in bf16 and 0.23-0.26% in fp16; the layouts
# are 0.14-0.24 D (bf16) and 0.16-0.27 D (fp16) from one process.
# What 2 D cannot see, measured by injecting each bug into the default layouts the same day:
# every step clips (the norm is ~1, CLIP 0.3), so the update does not depend on the gradient's
# size, and a gradient averaged twice over dp or not at all, or a loss scale left in, leaves the
# parameters where the bug-free run puts them (0.19-0.26 D). The clipping norm below catches each,
# ZeRO's too: 128 u and 256 u off in bf16, 1024 u and 2048 u in fp16, the loss scale ~1e8 u.
# Stepping the weights rounded to the format instead of fp32 masters moves them 1.18-1.24 D in bf16
# and 1.49-1.59 D in fp16, inside 2 D: `_check_masters` catches it exactly. Squares of the norm
# summed in the format instead of float64 move the norm by 0.2-0.9 u in bf16 (0.02-1.2 u in fp16):
# not caught, below what the norm's tolerance can tell from reordering, and 0.20-0.30 D in the
# parameters, as much as a correct layout.
# Losses: a scalar per step, too few values for that statistic. Each is a mean over 32 tokens
# computed in fp32 from logits in the format; a reordering moves each rounded value by at most
# a unit roundoff u relative, so the mean moves by at most u |loss| to first order (the
# roundings of different tokens are independent and mostly cancel). Measured: <= 0.007 u |loss|
# in bf16, <= 0.014 u in fp16.
# The clipping norm of step 0 (same weights, so only rounding differs): a root of a sum over
# every element's square, so it moves by u relative at most when every element does, and by
# the mean of their independent errors to first order. Measured: <= 0.17 u in bf16, <= 0.20 u in
# fp16 (ZeRO's included). A tied table or a replicated K/V head counted twice, or a stage's
# squares left out, moves it by 0.3% or more (the K/V head: 6 u in fp16; mutation checked in an
# earlier session; in bf16 the tolerance is wider than that).
TOLERANCE = 2.0  # x D, parameters; losses and the clipping norm: UNIT_ROUNDOFF x the value


def _check_layouts(layouts: list[tuple[str, dict]], world: int, precision: str) -> None:
    every_rank = run_on_ranks(_train, world, layouts, precision)
    initial = {k: v.float() for k, v in model().state_dict().items()}
    for i, ((name, layout), (losses, state, skipped, norm)) in enumerate(zip(layouts, every_rank[0])):
        dp = world // degrees(layout)
        clip = layout.get("clip", CLIP)
        expected_losses, expected = reference(precision, dp, clip)
        _, fp32 = reference(None, dp, clip)
        d_format = distance(expected, fp32)
        assert d_format > 1e-4 * distance(fp32, initial), (name, "the format must round something")
        assert skipped == 0, name  # no step overflowed: every step is compared
        for got, want in zip(losses, expected_losses):
            assert abs(got - want) <= UNIT_ROUNDOFF[precision] * abs(want), (name, losses, expected_losses)
        d_layout = distance(state, expected)
        assert d_layout <= TOLERANCE * d_format, (name, f"{d_layout:.3e} > {TOLERANCE} x {d_format:.3e}")
        if norm is not None:  # the whole model's norm, each parameter once: the same on every rank
            assert all(rank[i][3] == norm for rank in every_rank), name
            want = one_process_norm(precision, dp)
            assert abs(norm - want) <= UNIT_ROUNDOFF[precision] * want, (name, norm, want)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("world", [2, 4])
def test_layout_mixed_precision_every_layout_stays_within_the_format_tolerance_of_one_process(
        request, precision, world):
    layouts = WORLD2 if world == 2 else WORLD4
    if not request.config.getoption("--thorough"):
        layouts = [(n, lay) for n, lay in layouts if n in DEFAULT]
    _check_layouts(layouts, world, precision)


def _untied(layouts, precision):
    return _train(layouts, precision, tied=False)


def test_layout_mixed_precision_a_pipeline_changes_no_arithmetic_bit_for_bit(request):
    """pp 2 runs the reference's ops in the reference's order (accumulation over micro-batches
    in order, activations passed unchanged): untied and without clipping (the two sums a
    pipeline reorders) its parameters equal one process's in bf16 exactly, and pp 2 x tp 2's
    equal tp 2's. The reported loss is the one value summed otherwise: the last stage adds the
    micro-batches' loss_i / m in fp32 (one rounding, at most 2^-24 relative), one process in
    float64."""
    precisions = ("bf16", "fp16") if request.config.getoption("--thorough") else ("bf16",)
    pp2 = [("pp2_1f1b", {"pipeline": 2, "pipeline_schedule": "1f1b", "clip": 0.0}),
           ("pp2_interleaved", {"pipeline": 2, "pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2,
                                "clip": 0.0})]
    for precision in precisions:
        expected_losses, expected = reference(precision, 1, 0.0, tied=False)
        for (name, _), (losses, state, _, _) in zip(pp2, run_on_ranks(_untied, 2, pp2, precision)[0]):
            assert all(abs(a - b) <= 2.0**-24 * abs(b) for a, b in zip(losses, expected_losses)), (precision, name)
            assert all(torch.equal(state[k].float(), v) for k, v in expected.items()), (precision, name)
        (tp_losses, tp_state, _, _), = run_on_ranks(_untied, 2, [("tp2", {"tensor": 2, "clip": 0.0})], precision)[0]
        (losses, state, _, _), = run_on_ranks(_untied, 4, [("pp2_tp2", {"pipeline": 2, "tensor": 2, "clip": 0.0})],
                                           precision)[0]
        assert all(abs(a - b) <= 2.0**-24 * abs(b) for a, b in zip(losses, tp_losses)), precision
        assert all(torch.equal(state[k], v) for k, v in tp_state.items()), precision


# --- an inf on one rank of one axis

# --8<-- [start:inject]
INJECT = {  # layout -> (the rank whose gradient gets the inf, the parameter)
    "pp2_tp2": ({"pipeline": 2, "tensor": 2}, 3, "blocks.4.attn.wq.weight"),  # tp rank 1 of the last stage
    "tp2_cp2_zero1": ({"tensor": 2, "context": 2, "stage": 1}, 1, "blocks.0.mlp.w_down.weight"),  # a tp peer
    "tp2": ({"tensor": 2}, 1, "blocks.2.attn.wo.weight"),
    "cp2": ({"context": 2}, 0, "norm.weight"),
    # dp rank 1 of stage 0 (not the tied table: its gradient would carry the inf to the last stage)
    "dp2_pp2_zero1": ({"pipeline": 2, "stage": 1}, 1, "blocks.1.attn.wq.weight"),
    "dp2_pp2_zero3": ({"pipeline": 2, "stage": 3}, 2, "blocks.3.mlp.w_up.weight"),  # dp rank 0 of the last stage
}
# --8<-- [end:inject]


def _overflow(layout: dict, rank: int, name: str):
    """Step 0 overflows on `rank` only (an inf in one gradient there); step 1 is clean. On each
    rank: (state before, after step 0, after step 1; scale after each; skipped; losses)."""
    dp = dist.get_world_size() // degrees(layout)
    engine = ts.initialize(model(), config("fp16", dp, layout, fp16={"hysteresis": 1, "initial_scale_power": 12}))
    before = engine.full_state_dict()
    handle = None
    if dist.get_rank() == rank:
        param = dict(engine.model.named_parameters())[name]
        handle = param.register_hook(lambda g: torch.full_like(g, float("inf")))
    out, scales = [], []
    for step, batch in enumerate(batches(dp, steps=2)):
        out.append(engine.train_batch(batch))
        if handle is not None and step == 0:
            handle.remove()
        scales.append(engine.loss_scaler.scale)
        if step == 0:
            after_skip, skipped = engine.full_state_dict(), engine.skipped_steps
    return before, after_skip, engine.full_state_dict(), scales, skipped, engine.skipped_steps, out


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.thorough) if n in ("tp2", "cp2") else n
                                  for n in INJECT])  # tp2 and cp2 alone: covered by tp2_cp2_zero1 by default
def test_layout_mixed_precision_an_inf_on_one_rank_of_one_axis_skips_the_step_on_every_rank(name):
    layout, rank, param = INJECT[name]
    results = run_on_ranks(_overflow, degrees(layout) * (2 if name.startswith("dp2") else 1), layout, rank, param)
    for r, (before, after_skip, after, scales, skipped, total_skipped, losses) in enumerate(results):
        assert skipped == 1 and total_skipped == 1, (name, r)  # every rank skipped step 0, none step 1
        assert scales == [2.0**11, 2.0**11], (name, r)  # backed off together (hysteresis 1), then kept
        assert all(torch.equal(after_skip[k], v) for k, v in before.items()), (name, r, "a rank stepped")
        assert not all(torch.equal(after[k], v) for k, v in before.items()), (name, r, "step 1 must train")
        assert losses == results[0][-1], (name, r)


# --- checkpoints: the fp32 masters travel as full tensors under the original names

def _resume(layout: dict, path: str, precision: str):
    """Straight: 3 steps, a checkpoint after 2. Resumed: a fresh engine loads it, takes step 3."""
    dp = dist.get_world_size() // degrees(layout)
    cfg = config(precision, dp, layout)
    engine = ts.initialize(model(), cfg)
    for step, batch in enumerate(batches(dp)):
        if step == STEPS - 1:
            engine.save_checkpoint(path)
        straight = engine.train_batch(batch)
    resumed = ts.initialize(model(tied=True), cfg)
    resumed.load_checkpoint(path)
    loss = resumed.train_batch(batches(dp)[-1])
    return straight, engine.full_state_dict(), loss, resumed.full_state_dict()


@pytest.mark.parametrize(("name", "world", "layout", "precision"), [
    ("pp2_tp2", 4, {"pipeline": 2, "tensor": 2}, "bf16"),
    ("dp2_tp2_zero1", 4, {"tensor": 2, "stage": 1}, "fp16"),
])
def test_layout_mixed_precision_checkpoint_holds_full_masters_and_resumes_bit_for_bit(tmp_path, name, world,
                                                                                      layout, precision):
    from tinyscale.engine import checkpoint

    path = str(tmp_path / name)
    for straight, state, loss, resumed in run_on_ranks(_resume, world, layout, path, precision):
        assert loss == straight
        assert all(torch.equal(resumed[k], v) for k, v in state.items())
    model_state, optimizer_state, _ = checkpoint.read(path)
    # the model the file holds is the fp32 masters (as FSDP2 keeps its parameters): every parameter's,
    # whole, under the original model's names; the engine's fp16/bf16 parameters are them rounded
    assert set(model_state) == {n for n, _ in model().named_parameters()}
    assert all(master.dtype == torch.float32 for master in model_state.values())
    assert "masters" not in optimizer_state
