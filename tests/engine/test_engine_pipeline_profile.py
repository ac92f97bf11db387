"""wall_clock_breakdown and communication_data_type under a pipeline.

- wall_clock_breakdown (pp 2, 1F1B and zb_h1; zb_h1 at dp 2 x ZeRO 3 too): the engine's profile splits a pipelined step
  as it does a data-parallel one: forward = this rank's F actions, backward = its B, BW and
  W actions, optimizer = the step after the schedule, and the rest, waiting for a peer's
  activation or gradient (the bubble), posting messages, the dp / pp reductions, as
  comm_exposed (the host blocked in a receive's wait) and other. The categories add up to
  the step; `pipeline_bubble` is this rank's share of the schedule's time outside its
  compute actions, reported beside `tinyscale.pipeline.simulate`'s bubble for the schedule.
- communication_data_type (dp 2 x pp 2, ZeRO 0, 1, 2, 3): the data-parallel reduction after the
  schedule is sent in that dtype (the ledger's rows), and a float64 model trained with fp32
  communication equals one process within the bound its rounding derives, and equals dp 2
  without a pipeline at the same setting bit for bit (DDP, ZeRO 1; ZeRO 2 rounds once per
  micro-batch without a pipeline, once per step with one).
Run: `pytest tests/engine/test_engine_pipeline_profile.py` (keys engine_pipeline, mfu).
"""

from __future__ import annotations

import functools

import pytest
import torch

import tinyscale as ts
from tinyscale.data import local_micro_batches, synthetic_token_batches
from tinyscale.models import GPT, GPTConfig
from tinyscale.pipeline import simulator
from tinyscale.pipeline.schedules import BW, B, F, W
from tinyscale.testing import assert_state_dicts_close, run_on_ranks

PARTS = ("forward", "backward", "optimizer", "comm_exposed", "other")  # they partition the step


# --- wall_clock_breakdown ------------------------------------------------------------------

def _profiled(schedule: str, dp: int = 1, stage: int = 0) -> dict:
    cfg = GPTConfig(vocab_size=64, max_seq_len=16, n_layer=4, n_head=4, d_model=32, ffn_hidden=64)
    config = {"train_batch_size": 4 * dp, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
              "wall_clock_breakdown": True, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage}, "parallel": {"pipeline": 2, "pipeline_schedule": schedule}}
    engine = ts.initialize(GPT(cfg, seed=0), config)
    for b in synthetic_token_batches(num_batches=2, batch_size=4 * dp, seq_len=16, vocab_size=64, seed=0):
        engine.train_batch(b)
    mine = engine.pipeline.schedule[engine.pipeline.rank]
    return {"profile": engine.last_step["profile"], "seconds": engine.last_step["seconds"],
            "phases": {k: len(v) for k, v in engine.profiler.records[-1].phases.items()},
            "actions": {"forward": sum(a.kind == F for a in mine), "backward": sum(a.kind in (B, BW, W) for a in mine)},
            "simulated": float(simulator.simulate(engine.pipeline.schedule).bubble_fraction)}


# --- communication_data_type ---------------------------------------------------------------

VOCAB, SEQ, STEPS, M, LR, WD = 33, 6, 2, 2, 0.1, 0.01  # M micro-batches per dp rank


def _gpt() -> GPT:  # the odd GPT: vocab 33, 3 layers, GQA (2 K/V heads for 4), tied embeddings
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=3, n_head=4, n_kv_head=2, d_model=8,
                    ffn_hidden=12, tie_embeddings=True)
    return GPT(cfg, seed=5, dtype=torch.float64)


def _config(stage: int, dp: int, pp: int, comm: str | None = "fp32") -> dict:
    config = {"train_batch_size": M * dp, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": M,
              "optimizer": {"type": "SGD", "params": {"lr": LR, "weight_decay": WD}},
              "zero_optimization": {"stage": stage}, "communication_data_type": comm}
    return config | ({"parallel": {"pipeline": pp}} if pp > 1 else {})


def _batches(dp: int = 2):
    return synthetic_token_batches(num_batches=STEPS, batch_size=M * dp, seq_len=SEQ, vocab_size=VOCAB, seed=3)


def _comm_run(stage: int, pp: int) -> tuple:
    """dp 2 (x pp): losses, full state, and the dtypes of the dp reduction's gradient rows."""
    engine = ts.initialize(_gpt(), _config(stage, 2, pp))
    losses = []
    for b in _batches():
        engine.comm_ledger.clear()
        losses.append(engine.train_batch(b))
    if stage == 0:  # DDP's bucket all-reduces (not the loss's): rows of a bucket's element count
        numels = {b.buffer.numel() for b in engine.ddp.buckets}
        rows = [r for r in engine.comm_ledger.rows
                if r.op == "all_reduce" and r.bytes // getattr(torch, r.dtype).itemsize in numels]
    else:
        rows = [r for r in engine.comm_ledger.rows if r.op == "reduce_scatter"]
    units = len(engine.ddp.buckets) if stage == 0 else len(engine.zero.sharded.units)
    return losses, engine.full_state_dict(), [r.dtype for r in rows], units


@functools.cache
def _one_process_with_rank_terms(dp: int = 2):
    """One process, SGD on the mean loss; also, per element, the sum over steps and dp ranks
    of |that rank's term t_r| (its rows' gradient / dp): what rounding the reduction scales with;
    and per step, the sum over elements of |the step's gradient| x that sum so far (how far the
    loss can move, to first order, when each parameter is off by at most it)."""
    model = _gpt()
    terms_abs = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    losses, loss_moves = [], []
    for batch in _batches(dp):
        total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        before = {n: t.clone() for n, t in terms_abs.items()}  # the earlier steps' terms
        loss = 0.0
        for r in range(dp):
            model.zero_grad(set_to_none=True)
            micro = local_micro_batches(batch, dp_rank=r, dp_size=dp, micro_batch_size=1)
            for chunk in micro:
                step_loss = model(*chunk)
                (step_loss / (len(micro) * dp)).backward()
                loss += step_loss.item() / (len(micro) * dp)
            for n, p in model.named_parameters():
                terms_abs[n] += p.grad.abs()
                total[n] += p.grad
        losses.append(loss)
        loss_moves.append(sum((total[n].abs() * before[n]).sum().item() for n in total))
        with torch.no_grad():  # torch's SGD without momentum: p -= lr (g + wd p)
            for n, p in model.named_parameters():
                p -= LR * (total[n] + WD * p)
    return losses, model.state_dict(), terms_abs, loss_moves


# --- the pooled calls (one process pool per world size) -------------------------------------

STAGES = (0, 1, 2)
PROFILED = {"1f1b": (2, 1, 0), "zb_h1": (2, 1, 0), "zb_h1-dp2-zero3": (4, 2, 3)}  # name: world, dp, ZeRO stage


def _world2() -> dict:
    return {"profile": {name: _profiled(name.split("-")[0], dp, stage)
                        for name, (world, dp, stage) in PROFILED.items() if world == 2},
            "dp2": {stage: _comm_run(stage, pp=1) for stage in STAGES}}


def _world4() -> dict:
    return {"profile": {name: _profiled(name.split("-")[0], dp, stage)
                        for name, (world, dp, stage) in PROFILED.items() if world == 4},
            **{stage: _comm_run(stage, pp=2) for stage in (*STAGES, 3)}}


@functools.cache
def results(world: int) -> list:
    return run_on_ranks(_world2 if world == 2 else _world4, world, timeout_s=300)


@pytest.mark.parametrize("schedule", list(PROFILED))
def test_engine_pipeline_mfu_profile_phases_add_up_to_the_step(schedule):
    """zb_h1 at dp 2 x ZeRO 3 too: its all-gathers run in the executor's hooks, outside the phases."""
    bubbles, world = [], PROFILED[schedule][0]
    for rank, out in enumerate(results(world)):
        run = out["profile"][schedule]
        profile = run["profile"]
        # the categories partition the profiled step (interval arithmetic: equal up to rounding)
        assert sum(profile[k] for k in PARTS) == pytest.approx(profile["step"], rel=1e-9)
        assert all(profile[k] > 0 for k in ("forward", "backward", "optimizer")), (rank, profile)
        # one forward phase per F action of this rank, one backward per B, BW or W, one optimizer
        assert run["phases"] == {**run["actions"], "optimizer": 1}, rank
        # the schedule lies inside the step; its compute is the forward and backward phases
        assert profile["forward"] + profile["backward"] < profile["pipeline_schedule"] < profile["step"]
        assert 0 < profile["pipeline_bubble"] < 1
        assert profile["step"] == pytest.approx(run["seconds"], rel=0.05)  # the profiled block is the step
        bubbles.append(profile["pipeline_bubble"])
    simulated = results(world)[0]["profile"][schedule]["simulated"]
    # Loosely (2 shared cores: no timing is tight): the measured bubble is the simulated one plus the
    # host's overhead around each action, so not below half of it (F = B = W in the simulator only).
    print(f"{schedule}: measured bubble per rank {[round(b, 3) for b in bubbles]}, simulated {simulated:.3f}")
    assert sum(bubbles) / len(bubbles) > simulated / 2


@pytest.mark.parametrize("stage", (*STAGES, 3))
def test_engine_pipeline_communication_data_type_rounds_the_dp_reduction(stage):
    expected_losses, expected, terms_abs, loss_moves = _one_process_with_rank_terms()
    if stage == 0:  # the loop above is one process: tinyscale.reference at rtol 1e-10
        reference = _gpt()
        ts.reference.train(reference, _batches(), _config(0, 1, 1, comm=None) | {
            "train_batch_size": 2 * M, "gradient_accumulation_steps": 2 * M})
        assert_state_dicts_close(expected, reference.state_dict())
    u, n = 2.0 ** -24, 2  # fp32's unit roundoff, the dp ranks
    for out in results(4):
        losses, state, dtypes, _ = out[stage]
        assert dtypes and set(dtypes) == {"float32"}, dtypes  # the gradients crossed dp in fp32
        # Why this bound: each rank's term t_r (its rows' gradient / n) is rounded once to fp32
        # (<= u |t_r|) and the n terms are summed in it (<= (n-1) u sum |t_r|): per reduction
        # <= n u sum_r |t_r|, elementwise. SGD moves a parameter by lr x gradient (weight decay
        # shrinks an error, 1 - lr wd < 1), so after the steps its error is at most lr n u x
        # (the sum over steps and ranks of |t_r|); x2 for step 1's error changing step 2's gradient.
        for k, bound in terms_abs.items():
            diff = (state[k] - expected[k]).abs()
            assert (diff <= 2 * LR * n * u * bound).all(), (stage, k, (diff / bound).max().item())
        assert max((state[k] - expected[k]).abs().max().item() for k in expected) > 1e-15  # rounded: not fp64
        # The losses: a step's loss is computed in float64 from parameters each off by at most the
        # bound above for the earlier steps, so to first order it moves by at most sum_k |dL/dp_k|
        # x that bound (x2 for the second order and float64's own rounding): `loss_moves` (step 1:
        # no earlier step, float64's rtol 1e-10).
        for step, (got, want) in enumerate(zip(losses, expected_losses)):
            allowed = 2 * 2 * LR * n * u * loss_moves[step] + 1e-10 * abs(want)
            assert abs(got - want) <= allowed, (stage, step, got, want, allowed)


@pytest.mark.parametrize("stage", STAGES)
def test_engine_pipeline_communication_data_type_equals_dp_without_pipeline(stage):
    """dp 2 x pp 2 against dp 2 alone, both at fp32. DDP and ZeRO 1 reduce once per step in
    both: the same elementwise roundings and sums (each element's two terms, each rank's
    float64 gradient, bit-identical with and without the pipeline), so bit-identical training.
    ZeRO 2 is not: alone it reduce-scatters every micro-batch's gradient (each rounded to fp32,
    the M sums added in float64), under the pipeline once per step after the schedule (the M
    micro-batches summed in float64, then rounded once): other roundings, both within the
    bound of the test above; the ledger shows the difference."""
    want_losses, want_state, _, units = results(2)[0]["dp2"][stage]
    for out in results(4):
        losses, state, dtypes, pp_units = out[stage]
        if stage == 2:
            assert len(dtypes) == pp_units and len(results(2)[0]["dp2"][stage][2]) == M * units  # the last step's
            assert any(not torch.equal(state[k], want_state[k]) for k in want_state)
            continue
        assert losses == want_losses
        for k in want_state:
            assert torch.equal(state[k], want_state[k]), (stage, k)
