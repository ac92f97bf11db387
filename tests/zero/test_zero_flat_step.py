"""The sharded step on one flat tensor per unit (`tinyscale.zero.flat_step`) computes the same
bits as the per-fragment step and as a plain torch optimizer (`pytest -k zero_flat`).

Both paths run the same elementwise arithmetic on the same values, so the comparisons are
`torch.equal`, not a tolerance. One process (a group of one: a unit's shard is the whole
unit, its fragments whole parameters) for the optimizer's bookkeeping; three ranks through
the engine for fragments that straddle shards and padded units.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tinyscale as ts
from tinyscale.precision.scaler import DynamicLossScaler
from tinyscale.data import synthetic_regression_batches
from tinyscale.models import TinyMLP
from tinyscale.testing import assert_state_dicts_close, run_on_ranks
from tinyscale.zero import flat_step
from tinyscale.zero.optimizer import ShardedOptimizer
from tinyscale.zero.state_dict import gather_optimizer_state, load_optimizer_state

STEPS = 5


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 7), nn.LayerNorm(7),
                         nn.Linear(7, 3)).double()


def _groups(model: nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() > 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": [p for p in model.parameters() if p.dim() <= 1],
                                                     "weight_decay": 0.0}]


OPTIMIZERS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2, weight_decay=0.05),
    "sgd": lambda groups: torch.optim.SGD(groups, lr=1e-2, momentum=0.9, dampening=0.1, nesterov=False),
    # elementwise flags: amsgrad (an elementwise max kept in the state), maximize (the gradient negated)
    "adam_amsgrad": lambda groups: torch.optim.Adam(groups, lr=1e-2, weight_decay=0.05, amsgrad=True),
    "adamw_amsgrad_maximize": lambda groups: torch.optim.AdamW(groups, lr=1e-2, amsgrad=True, maximize=True),
    "sgd_nesterov_maximize": lambda groups: torch.optim.SGD(groups, lr=1e-2, momentum=0.9, nesterov=True,
                                                            maximize=True),
}


def _grads(model: nn.Module, step: int, unused: set[int], inf_at: int | None) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(100 + step)
    grads = [None if k in unused else torch.randn(p.shape, generator=gen, dtype=p.dtype)
             for k, p in enumerate(model.parameters())]
    if step == inf_at:
        grads[0][0, 0] = float("inf")
    return grads


def _step(sharded: ShardedOptimizer, model: nn.Module, grads: list, max_norm: float) -> bool:
    by_param = {id(p): g for p, g in zip(model.parameters(), grads)}
    for i, unit in enumerate(sharded.units):
        unit_grads = [by_param[id(p)] for p in unit.params]
        if any(g is not None for g in unit_grads):
            sharded.reduce_scatter_into(i, unit_grads).wait()
        for p, g in zip(unit.params, unit_grads):
            if g is not None:
                sharded.mark_used(p)
    return sharded.full_step(max_norm)


def _run(opt: str, flat: bool, steps=range(STEPS), unused_at=None, inf_at=None, sub_group_size=None,
         max_norm=1.0, model=None, sharded=None):
    model = _model() if model is None else model
    if sharded is None:
        scaler = DynamicLossScaler(initial_scale_power=0) if inf_at is not None else None
        sharded = ShardedOptimizer(_groups(model), OPTIMIZERS[opt], unit_bytes=8 * 40, loss_scaler=scaler,
                                   sub_group_size=sub_group_size)
        sharded.flat_step = flat
    for step in steps:
        unused = {0, 1} if step in (unused_at or ()) else set()  # the first Linear: no gradient
        _step(sharded, model, _grads(model, step, unused, inf_at), max_norm)
    return model, sharded


def _states(sharded: ShardedOptimizer) -> list[dict]:
    return [dict(sharded.optimizer.state.get(f.view, {})) for frags in sharded.fragments for f in frags]


def _assert_same(a: tuple, b: tuple, states: bool = True) -> None:
    (ma, sa), (mb, sb) = a, b
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        assert torch.equal(pa, pb)
    for x, y in zip(sa.master, sb.master):
        assert torch.equal(x, y)
    for x, y in zip(_states(sa), _states(sb)) if states else ():
        assert x.keys() == y.keys()
        for k in x:
            assert (x[k] is None and y[k] is None) or torch.equal(x[k], y[k]), k


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_zero_flat_step_equals_fragment_step_and_torch(opt):
    """Several units, weight decay in one group only, clipping on: flat == per fragment ==
    torch's optimizer on the whole parameters, bit for bit; the flat path was taken."""
    flat, frag = _run(opt, True), _run(opt, False)
    assert len(flat[1].units) >= 3
    assert flat[1].flat.stepped == STEPS * len(flat[1].units)  # each unit one piece (under PIECE_BYTES)
    assert frag[1].flat.stepped == 0
    _assert_same(flat, frag)
    ref = _model()
    torch_opt = OPTIMIZERS[opt](_groups(ref))
    for step in range(STEPS):
        for p, g in zip(ref.parameters(), _grads(ref, step, set(), None)):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        torch_opt.step()
    for p, q in zip(flat[0].parameters(), ref.parameters()):
        assert torch.equal(p, q)
    # tied: each fragment's tensor states are views of one flat state per unit
    state = flat[1].optimizer.state
    keys = ["momentum_buffer"] if opt.startswith("sgd") else ["exp_avg", "exp_avg_sq"]
    keys += ["max_exp_avg_sq"] if "amsgrad" in opt else []
    for frags in flat[1].fragments:
        for key in keys:
            bases = {state[f.view][key].untyped_storage().data_ptr() for f in frags}
            assert len(bases) == 1


def test_zero_flat_step_pieces_cut_at_fragments_equal_fragment_step(monkeypatch):
    """PIECE_BYTES under a unit's size: several pieces a unit, each whole fragments, the same bits."""
    monkeypatch.setattr(flat_step, "PIECE_BYTES", 8 * 12)
    flat = _run("adamw", True, unused_at={2})
    pieces = [p for row in flat[1].flat.pieces for p in row]
    assert len(pieces) > len(flat[1].units)
    assert all(p.end - p.start <= 12 or len(p.ks) == 1 for p in pieces)
    _assert_same(flat, _run("adamw", False, unused_at={2}))


def test_zero_flat_step_unused_parameter_mid_run_is_skipped():
    """A parameter without a gradient at step 2: its piece steps per fragment that step (the
    parameter untouched: no decay, no state change, step count behind); back to flat after:
    `test_zero_flat_step_piece_returns_flat_when_every_parameter_is_used_again`."""
    flat, frag = _run("adamw", True, unused_at={2}), _run("adamw", False, unused_at={2})
    _assert_same(flat, frag)
    sharded = flat[1]
    weight = next(f for frags in sharded.fragments for f in frags if f.param is flat[0][0].weight)
    other = next(f for frags in sharded.fragments for f in frags if f.param is flat[0][2].weight)
    assert sharded.optimizer.state[weight.view]["step"].item() == STEPS - 1
    assert sharded.optimizer.state[other.view]["step"].item() == STEPS
    # before the gap, and the gap itself: the state does not move when the parameter is skipped
    before, sb = _run("adamw", True, steps=range(2))
    _run("adamw", True, steps=[2], unused_at={2}, model=before, sharded=sb)
    w = next(f for frags in sb.fragments for f in frags if f.param is before[0].weight)
    assert sb.optimizer.state[w.view]["step"].item() == 2
    again, sa = _run("adamw", True, steps=range(2))
    w2 = next(f for frags in sa.fragments for f in frags if f.param is again[0].weight)
    assert torch.equal(sb.optimizer.state[w.view]["exp_avg"], sa.optimizer.state[w2.view]["exp_avg"])
    assert torch.equal(before[0].weight, again[0].weight)


@pytest.mark.parametrize("sub_group_size", [7, 40])
def test_zero_flat_step_sub_groups_equal_fragment_step(sub_group_size):
    """sub_group_size cuts units: one flat piece per unit and sub-group, the same bits."""
    flat = _run("adamw", True, sub_group_size=sub_group_size)
    _assert_same(flat, _run("adamw", False, sub_group_size=sub_group_size))
    _assert_same(flat, _run("adamw", True), states=False)  # other cuts: other fragments
    assert flat[1].flat.stepped >= STEPS * len(flat[1].units)
    assert max(p.end - p.start for row in flat[1].flat.pieces for p in row) <= sub_group_size


def test_zero_flat_step_fp16_overflow_skip():
    """An overflowing gradient at step 2: both paths skip the step on every tensor."""
    _assert_same(_run("adamw", True, inf_at=2), _run("adamw", False, inf_at=2))
    skipped, _ = _run("adamw", True, inf_at=0, steps=[0])
    assert torch.equal(skipped[0].weight, _model()[0].weight)


def _names(model):
    return {id(p): n for n, p in model.named_parameters()}


@pytest.mark.parametrize("save_flat,load_flat", [(True, False), (False, True), (True, True)])
def test_zero_flat_step_checkpoint_crosses_paths(save_flat, load_flat):
    """Saved after 3 steps on one path, loaded into a fresh run on the other, 2 more steps:
    the same bits as 5 uninterrupted steps (the flat states re-tied from the loaded ones)."""
    whole = _run("adamw", True, unused_at={1})
    first = _run("adamw", save_flat, steps=range(3), unused_at={1})
    saved = gather_optimizer_state(first[1], _names(first[0]))
    model = _model(seed=1)
    with torch.no_grad():
        for p, q in zip(model.parameters(), first[0].parameters()):
            p.copy_(q)
    sharded = ShardedOptimizer(_groups(model), OPTIMIZERS["adamw"], unit_bytes=8 * 40)
    sharded.flat_step = load_flat
    load_optimizer_state(sharded, saved, _names(model))
    _run("adamw", load_flat, steps=range(3, STEPS), unused_at={1}, model=model, sharded=sharded)
    _assert_same(whole, (model, sharded))
    # the saved form is the same whichever path wrote it
    other_model, other_sharded = _run("adamw", not save_flat, steps=range(3), unused_at={1})
    other = gather_optimizer_state(other_sharded, _names(other_model))
    for name, entry in saved["state"].items():
        for k, v in entry.items():
            assert torch.equal(v, other["state"][name][k])


def test_zero_flat_step_torch_load_state_dict_reties():
    """torch's own load_state_dict replaces the state tensors: the next step re-ties them."""
    a = _run("adamw", True, steps=range(2))
    b = _run("adamw", True, steps=range(2))
    b[1].optimizer.load_state_dict(copy.deepcopy(a[1].optimizer.state_dict()))  # (torch shares `step`)
    _run("adamw", True, steps=range(2, STEPS), model=a[0], sharded=a[1])
    _run("adamw", True, steps=range(2, STEPS), model=b[0], sharded=b[1])
    _assert_same(a, b)
    _assert_same(a, _run("adamw", False))


def test_zero_flat_step_refuses_what_it_cannot_keep_exact():
    """Other optimizer types (a subclass too) and untested flags keep the per-fragment path."""
    class MyAdamW(torch.optim.AdamW):
        pass

    for make in (lambda g: MyAdamW(g), lambda g: torch.optim.Adam(g, differentiable=True),
                 lambda g: torch.optim.SGD(g, lr=0.1, differentiable=True), lambda g: torch.optim.Adagrad(g)):
        assert ShardedOptimizer(_groups(_model()), make).flat is None
    for make in (lambda g: torch.optim.Adam(g, amsgrad=True), lambda g: torch.optim.SGD(g, lr=0.1, maximize=True)):
        assert ShardedOptimizer(_groups(_model()), make).flat is not None  # tested above, bit for bit


def _engine_run(stage, flat):
    engine = ts.initialize(TinyMLP(seed=0), _engine_config(stage))
    engine.zero.sharded.flat_step = flat
    for b in synthetic_regression_batches(num_batches=3, batch_size=12, dim=8, seed=0):
        engine.train_batch(b)
    sharded = engine.zero.sharded
    # the padding past a unit's last fragment: never stepped (weight decay on), so exactly zero
    padding = [m[frags[-1].end if frags else 0:] for m, frags in zip(sharded.master, sharded.fragments)]
    return engine.full_state_dict(), sharded.flat.stepped, sum(p.numel() for p in padding), \
        all(not p.any() for p in padding)


def _engine_config(stage):
    return {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 100}}


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_flat_step_engine_three_ranks_equals_fragment_step(stage):
    """Three ranks through the engine (TinyMLP: a tied weight, a frozen layer; several units,
    fragments straddling shards; clipping, weight decay, accumulation 2): the flat path is
    taken, gives the fragment path's bits, and matches the float64 reference."""
    flat, frag = run_on_ranks(_engine_run, 3, stage, True), run_on_ranks(_engine_run, 3, stage, False)
    ref = TinyMLP(seed=0)
    ts.reference.train(ref, synthetic_regression_batches(num_batches=3, batch_size=12, dim=8, seed=0),
                       _engine_config(stage))
    assert sum(r[2] for r in flat) > 0  # some unit is padded
    for (sf, nf, _, zero_pad), (sg, ng, _, _) in zip(flat, frag):
        assert nf > 0 and ng == 0 and zero_pad
        assert all(torch.equal(sf[k], sg[k]) for k in sf)
        assert_state_dicts_close(sf, ref.state_dict())


def test_zero_flat_step_replaced_state_dicts_retie():
    """A loader that replaces the state dicts (as DCP's does) unties: the next step re-ties."""
    a, b = _run("adamw", True, steps=range(2)), _run("adamw", True, steps=range(2))
    saved = {f.view: copy.deepcopy(b[1].optimizer.state[f.view]) for frags in b[1].fragments for f in frags}
    for st in saved.values():
        st["exp_avg"].mul_(0.5)
    b[1].optimizer.state.clear()
    b[1].optimizer.state.update(saved)
    for st in (a[1].optimizer.state[f.view] for frags in a[1].fragments for f in frags):
        st["exp_avg"].mul_(0.5)  # in place: a stays tied
    _run("adamw", True, steps=range(2, STEPS), model=a[0], sharded=a[1])
    _run("adamw", True, steps=range(2, STEPS), model=b[0], sharded=b[1])
    _assert_same(a, b)
    assert b[1].flat.stepped == a[1].flat.stepped


def _torch_run(opt: str, unused_at=()) -> nn.Module:
    """Plain torch on the whole parameters: a parameter without a gradient is skipped (None)."""
    ref = _model()
    torch_opt = OPTIMIZERS[opt](_groups(ref))
    for step in range(STEPS):
        for p, g in zip(ref.parameters(), _grads(ref, step, {0, 1} if step in unused_at else set(), None)):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        torch_opt.step()
    return ref


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_zero_flat_step_piece_returns_flat_when_every_parameter_is_used_again(opt):
    """The first Linear has no gradient at steps 2 and 3: its piece (the LayerNorm after it is
    used) steps per fragment then. At step 4 every parameter has one again: every fragment steps
    flat (Adam: the piece cut into runs whose step counts agree), the same bits as the per-fragment
    step and torch."""
    model, sharded = _run(opt, True, steps=range(4), unused_at={2, 3})
    flat = sharded.flat
    assert any(not p.tied and len(p.ks) > 1 for row in flat.pieces for p in row)  # per fragment, mixed
    before = flat.stepped
    _run(opt, True, steps=[4], model=model, sharded=sharded)
    pieces = [p for row in flat.pieces for p in row]
    assert all(p.tied for p in pieces) and flat.stepped - before == len(pieces)
    assert sorted((p.unit, k) for p in pieces for k in p.ks) == \
        sorted((i, k) for i, frags in enumerate(sharded.fragments) for k in range(len(frags)))
    if opt == "adamw":
        assert len(pieces) > len(sharded.units)  # cut where the step counts differ
    _assert_same((model, sharded), _run(opt, False, unused_at={2, 3}))
    for p, q in zip(model.parameters(), _torch_run(opt, unused_at={2, 3}).parameters()):
        assert torch.equal(p, q)


def test_zero_flat_step_scalar_written_in_place_unties():
    """Adam's step counts reset in place by a user (`fill_`) between steps: the flat path sees the
    write (its version counter), ties again from the fragments and keeps the per-fragment bits."""
    a, b = _run("adamw", True, steps=range(2)), _run("adamw", False, steps=range(2))
    for sharded in (a[1], b[1]):
        for state in sharded.optimizer.state.values():
            state["step"].fill_(1)
    _run("adamw", True, steps=range(2, STEPS), model=a[0], sharded=a[1])
    _run("adamw", False, steps=range(2, STEPS), model=b[0], sharded=b[1])
    _assert_same(a, b)
    assert a[1].flat.stepped == STEPS * len(a[1].units)  # still flat throughout
