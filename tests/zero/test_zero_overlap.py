"""ZeRO stages 1 and 2 reduce-scatter in buckets while the step's last backward runs (`pytest -k overlap`).

Stage 1 accumulates under `no_sync()` and reduces in the last backward, as DeepSpeed's stage 1
does; stage 2 in every backward; both with a small first bucket (`first_bucket_bytes`, torch
DDP's layout). The property: float64 training on 3 ranks equals one process at rtol 1e-10
(tinyscale.testing), with 3 accumulated micro-batches, clipping, weight decay, the model of
`test_unused` (a frozen layer, a weight used twice, a layer no forward uses, one used by some
rows only), a step that raises on one rank inside a backward (after some buckets went out,
or in the first micro-batch) and is dropped on every rank and retried, and a step that
overflows (an inf gradient on one rank) and is skipped by the loss scaler on every rank.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from tests.zero.test_unused import UnusedMLP
from tinyscale.models import TinyMLP
from tinyscale.precision.scaler import DynamicLossScaler
from tinyscale.testing import assert_state_dicts_close, run_on_ranks, state_dict_cpu
from tinyscale.zero import split_into_units

WORLD, MICRO, ACCUM, STEPS = 3, 2, 3, 4
CLIP, FAIL_STEP, OVERFLOW_STEP = 0.05, 1, 2
LR, DECAY = 1e-2, 0.05


def _batches():
    gen = torch.Generator().manual_seed(3)
    out = []
    for step in range(STEPS):
        x = torch.randn(WORLD * ACCUM * MICRO, 8, generator=gen, dtype=torch.float64).clamp(-3, 3)
        x[[1, 8 + step], 0] = 10.0  # rows that use `extra`: some ranks' micro-batches only
        out.append((x, torch.randn(x.shape, generator=gen, dtype=torch.float64)))
    return out


def _rows(rank: int, micro: int) -> slice:
    start = (rank * ACCUM + micro) * MICRO
    return slice(start, start + MICRO)


def _order(model):
    """Reversed into buckets, the output side comes first, so buckets fill (and go) mid-backward;
    the unused bias shares a bucket with `extra`'s (its slot must count as zero)."""
    return [model.unused.weight, model.extra.weight, model.unused.bias, model.extra.bias, model.fc_in.weight,
            model.fc_in.bias, model.shared.weight, model.shared.bias, model.out_bias]


def _train(stage: int, overlap: bool, fail_micro: int, overlap_param_gather: bool = False):
    from tinyscale.zero import ZeroStage1, ZeroStage2

    rank = dist.get_rank()
    model = UnusedMLP(seed=0)
    make = lambda groups: torch.optim.AdamW(groups, lr=LR, weight_decay=DECAY)  # noqa: E731
    kw = {"bucket_bytes": 8 * 150, "first_bucket_bytes": 8 * 40, "overlap": overlap,
          "loss_scaler": DynamicLossScaler(initial_scale_power=4, hysteresis=1)}
    if overlap_param_gather:
        kw.update(overlap_param_gather=True, module=model)
    zero = (ZeroStage1 if stage == 1 else ZeroStage2)(_order(model), make, **kw)
    if overlap_param_gather:  # stage 2 in pieces of 16 elements: several per unit, at parameter boundaries
        zero.sharded.gather_piece_numel = 16 if stage == 2 else None
    trap = {"on": False}

    def raise_in_backward(grad):  # fc_in.weight's gradient comes last: other buckets are out by then
        if trap["on"]:
            raise MemoryError("simulated")
        return grad

    def overflow(grad):
        return grad * float("inf") if trap.get("inf") else grad

    model.fc_in.weight.register_hook(raise_in_backward)
    model.out_bias.register_hook(overflow)
    launched_mid_backward, skipped = [], []
    for step, (x, y) in enumerate(_batches()):
        for attempt in range(2 if step == FAIL_STEP else 1):
            failed, micro = 0.0, 0
            try:
                for micro in range(ACCUM):
                    last = micro == ACCUM - 1
                    trap["on"] = step == FAIL_STEP and attempt == 0 and rank == WORLD - 1 and micro == fail_micro
                    trap["inf"] = step == OVERFLOW_STEP and rank == 0 and last
                    with zero.no_sync() if stage == 1 and not last else contextlib.nullcontext():
                        (model(x[_rows(rank, micro)], y[_rows(rank, micro)]) * zero.sharded.loss_scaler.scale
                         / ACCUM).backward()
            except MemoryError:
                failed = 1.0
                zero.complete_abandoned(ACCUM - micro)  # the collectives the other ranks make
            flag = torch.tensor([failed])
            dist.all_reduce(flag)  # the engine's agreement: every rank drops a step that failed anywhere
            if flag.item():
                zero.abandon_backward()
                continue
            if step == 0:
                end = next(t for kind, _, t in zero.events if kind == "backward_end")
                launched_mid_backward = [t < end for kind, _, t in zero.events if kind == "launch"]
            skipped.append(zero.step(max_norm=CLIP))
    return state_dict_cpu(model), launched_mid_backward, skipped, len(zero.sharded.units)


def one_process_step(model, params, opt, x, y, rows, world: int, accum: int, clip: float) -> None:
    """One step of the one-process truth: every rank's micro-batches (`rows(rank, micro)`), averaged."""
    for rank in range(world):
        for micro in range(accum):
            (model(x[rows(rank, micro)], y[rows(rank, micro)]) / (accum * world)).backward()
    torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _one_process():
    model = UnusedMLP(seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=DECAY)
    for step, (x, y) in enumerate(_batches()):
        if step == OVERFLOW_STEP:
            continue  # skipped on every rank
        one_process_step(model, params, opt, x, y, _rows, WORLD, ACCUM, CLIP)
    return state_dict_cpu(model)


@pytest.mark.parametrize("fail_micro", [0, ACCUM - 1], ids=["fail_first_micro", "fail_last_backward"])
@pytest.mark.parametrize(("stage", "overlap", "param_gather"),
                         [(1, True, False), (1, False, False), (2, True, False), (1, True, True), (2, True, True)],
                         ids=["zero1_overlap", "zero1_no_overlap", "zero2_overlap", "zero1_overlap_param_gather",
                              "zero2_overlap_param_gather"])
def test_zero1_zero2_overlap_first_bucket_matches_single_process_float64(stage, overlap, param_gather, fail_micro):
    """(overlap_param_gather: the step's gathers left in flight, waited for by the next forward's
    modules; the failed step's abandon and the retried forward wait for them too.)"""
    expected = _one_process()
    for state, launched, skipped, units in run_on_ranks(_train, WORLD, stage, overlap, fail_micro, param_gather):
        assert units > 2
        assert_state_dicts_close(state, expected, what=f"zero{stage} overlap={overlap} vs one process")
        assert skipped == [False, False, True, False]  # the overflow step, on every rank
        # overlap: the first bucket (a small one) went out while backward ran; else all at its end
        assert launched[0] is overlap and len(launched) == units


def _flat_params_run(stage: int):
    from tinyscale.models import TinyMLP
    from tinyscale.zero import ZeroStage1, ZeroStage2

    rank, model = dist.get_rank(), TinyMLP(seed=1)
    make = lambda groups: torch.optim.AdamW(groups, lr=LR, weight_decay=DECAY)  # noqa: E731
    zero = (ZeroStage1 if stage == 1 else ZeroStage2)(model.parameters(), make, bucket_bytes=8 * 200)
    inside = []
    for step, (x, y) in enumerate(_batches()):
        if step == 2:  # the parameters get new storage (.data replaced), the values kept
            for p in model.parameters():
                p.data = p.data.clone()
        model(x[_rows(rank, 0)], y[_rows(rank, 0)]).backward()
        zero.step()
        flats = [(f.data_ptr(), f.data_ptr() + f.numel() * f.element_size()) for f in zero.sharded._params_flat]
        inside.append(all(any(lo <= p.data_ptr() < hi for lo, hi in flats)
                          for p in model.parameters() if p.requires_grad))
    return state_dict_cpu(model), inside


@pytest.mark.parametrize("stage", [1, 2], ids=["zero1", "zero2"])
def test_zero1_zero2_flat_buffer_parameters_are_the_all_gather_output(stage):
    """After every step each trainable parameter is a view of its unit's flat buffer, which the
    all-gather wrote (no copy out of a gathered buffer); parameters given new storage between
    steps (``p.data = ...``) are taken back, and training equals one process (float64, rtol 1e-10)."""
    from tinyscale.models import TinyMLP

    model = TinyMLP(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    for x, y in _batches():
        for rank in range(2):
            (model(x[_rows(rank, 0)], y[_rows(rank, 0)]) / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for state, inside in run_on_ranks(_flat_params_run, 2, stage):
        assert_state_dicts_close(state, state_dict_cpu(model), what=f"zero{stage} flat parameters vs one process")
        assert inside == [True] * STEPS


def test_zero1_zero2_first_unit_closes_as_torch_ddps_first_bucket():
    """`first_bucket_bytes` cuts ZeRO's units as torch DDP cuts its buckets: the first closes once
    it holds that many bytes (the parameter that crosses it goes in), the rest up to the cap, so
    the last unit, reduced after backward ends, is as large as torch's last bucket (lesson 02)."""
    params = [p for p in TinyMLP().parameters() if p.requires_grad]  # bytes, last first: 128 2048 128 1024 64

    def sizes(cap, first):
        return [len(u.params) for u in split_into_units(params, cap, 2, 0, reverse=True, first_cap_bytes=first)]
    assert sizes(2**30, 2200) == [3, 2]  # 128 + 2048 = 2176 < 2200: the next 128 still goes in
    assert sizes(2**30, 2176) == [2, 3]  # reached: closed
    assert sizes(1200, 2200) == [1, 1, 2, 1]  # never beyond the cap
    assert sizes(None, 2200) == [3, 2]
