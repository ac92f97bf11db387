"""The engine's MFU and HFU (`pytest -k mfu`): on a scripted clock they equal the formulas
of `tinyscale.mfu` over the window of steps, and the CLI summary reports them."""

from __future__ import annotations

import itertools

import pytest
import torch

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.mfu import hfu, mfu
from tinyscale.models import GPT, GPTConfig, TinyMLP
from tinyscale.testing import run_on_ranks

PEAK = 3.0e11  # FLOP/s of a pretend device


def _engine(ac=None):
    cfg = GPTConfig(vocab_size=256, max_seq_len=16, n_layer=4, n_head=4, d_model=16, ffn_hidden=40)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if ac:
        config["activation_checkpointing"] = ac
    return cfg, ts.initialize(GPT(cfg, seed=0), config, peak_flops=PEAK)


@pytest.mark.parametrize(("ac", "recompute", "layers"), [(None, "none", None), ({"policy": "full"}, "full", None),
                                                          ({"policy": "every_k", "every_k": 2}, "full", 2),
                                                          ({"policy": "selective"}, "selective", None)])
def test_engine_mfu_on_a_scripted_clock_equals_the_formula(ac, recompute, layers):
    cfg, engine = _engine(ac)
    durations = [2.0, 1.0, 4.0]
    ends = itertools.accumulate(durations)
    engine._clock = iter(t for end, d in zip(ends, durations) for t in (end - d, end)).__next__
    batches = synthetic_token_batches(num_batches=3, batch_size=2, seq_len=12, seed=0)  # shorter than max
    for b in batches:
        engine.train_batch(b)
    tokens_per_s = 3 * 2 * 12 / sum(durations)  # tokens and seconds summed over the window
    got = engine.last_step
    assert got["tokens"] == 24 and got["seconds"] == 4.0 and got["tokens_per_s"] == tokens_per_s
    # the same quantities through the same arithmetic, associated differently: 1e-12 is
    # thousands of ulps, and a wrong FLOP count or window would be off by percent
    assert got["mfu"] == pytest.approx(mfu(tokens_per_s, cfg, PEAK, seq_len=12), rel=1e-12)
    assert got["hfu"] == pytest.approx(hfu(tokens_per_s, cfg, PEAK, seq_len=12, recompute=recompute,
                                           recomputed_layers=layers), rel=1e-12)
    assert got["hfu"] > got["mfu"]  # the SDPA core's backward recomputes Q K^T (tinyscale.mfu.flops)
    assert (got["hfu"] > hfu(tokens_per_s, cfg, PEAK, seq_len=12)) == (recompute != "none")


def test_engine_mfu_is_absent_without_a_peak_or_a_gpt():
    engine = ts.initialize(TinyMLP(seed=0), {"train_micro_batch_size_per_gpu": 4}, peak_flops=PEAK)
    engine.train_batch((torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)))
    assert engine.last_step["mfu"] is None and engine.last_step["tokens"] == 4  # rows, not tokens
    cfg = GPTConfig(vocab_size=256, max_seq_len=16, n_layer=1, n_head=2, d_model=8, ffn_hidden=16)
    engine = ts.initialize(GPT(cfg, seed=0), {"train_micro_batch_size_per_gpu": 2})  # a CPU has no table peak
    engine.train_batch(synthetic_token_batches(num_batches=1, batch_size=2, seq_len=16, seed=0)[0])
    assert engine.last_step["mfu"] is None and engine.last_step["tokens_per_s"] > 0
    with pytest.raises(ValueError, match="peak_flops"):
        ts.initialize(GPT(cfg, seed=0), {"train_micro_batch_size_per_gpu": 2}, peak_flops=-1.0)


def _profiled(stage):
    import time

    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    import torch.distributed as dist

    from tinyscale.dist import comm

    cfg = GPTConfig(vocab_size=256, max_seq_len=16, n_layer=2, n_head=4, d_model=16, ffn_hidden=40)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "wall_clock_breakdown": True,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}
    engine = ts.initialize(GPT(cfg, seed=0), config)
    reads = []  # the engine's own clock reads: train_batch's start and the read its "seconds" ends at

    def clock():
        reads.append(time.perf_counter())
        return reads[-1]

    engine._clock = clock
    work = []  # when the step's work ran, on the profiler's clock (perf_counter): every forward, every optimizer step
    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(lambda *a: work.append(time.perf_counter())),
             register_optimizer_step_pre_hook(lambda *a: work.append(time.perf_counter())),
             register_optimizer_step_post_hook(lambda *a: work.append(time.perf_counter()))]
    try:
        for b in synthetic_token_batches(num_batches=3, batch_size=4 * dist.get_world_size(), seq_len=16, seed=0):
            reads.clear(), work.clear()
            with comm.record() as ledger:  # every collective of train_batch, inside the profiled block or not
                engine.train_batch(b)
    finally:
        for h in hooks:
            h.remove()
    rec = engine.profiler.records[-1]
    sent = [(r.start, r.end) for r in ledger.rows if r.start <= reads[1]]  # the monitor's gather comes after
    return engine.last_step, len(engine.profiler.records), reads[:2], (rec.start, rec.end), work, sent


@pytest.mark.parametrize("stage", [0, 3])
def test_engine_profile_wall_clock_breakdown_adds_up_to_the_step(stage):
    for last, steps, (t0, t1), (start, end), work, sent in run_on_ranks(_profiled, 2, stage):
        profile = last["profile"]
        assert steps == 3
        parts = ("forward", "backward", "optimizer", "comm_exposed", "other")
        # the categories partition the profiled step (interval arithmetic: equal up to rounding)
        assert sum(profile[k] for k in parts) == pytest.approx(profile["step"], rel=1e-9)
        assert all(profile[k] > 0 for k in ("forward", "backward", "optimizer"))
        assert profile["comm_in_flight"] > 0  # gradients (and stage 3's gathers) crossed ranks
        # The profiled block is all of train_batch's work, on one clock (perf_counter), exactly:
        # train_batch's "seconds" is [t0, t1]; the profiled step [start, end] lies inside it, and the
        # untimed gaps around it (the argument check before, the record's arithmetic after) are
        # measured, not bounded by a share of the step that load could exceed.
        assert last["seconds"] == t1 - t0 and profile["step"] == end - start
        assert t0 <= start <= end <= t1
        gaps = (start - t0) + (t1 - end)
        assert gaps + profile["step"] == pytest.approx(last["seconds"], rel=1e-12)  # rounding of 3 sums only
        # ... and the gaps hold no work: every forward, optimizer step and collective of the
        # step ran inside the profiled block
        assert len(work) >= 2 * 2 + 2 and len(sent) > 0  # 2 micro-batches' forwards, the step's pre and post
        assert all(start <= t <= end for t in work)
        assert all(start <= s and (e is None or e <= end) for s, e in sent)
