"""Parameters without a gradient train exactly as in one process, at every ZeRO stage
(`pytest -k unused`; DESIGN.md, "Composing layouts"; lesson 02, "Unused parameters").

The model is TinyMLP (a frozen layer, a tied weight, a layer used twice) plus a layer no
forward uses and a layer used only for rows whose first feature is large. Which rows are
large is chosen per step, so that layer is used on one rank only, in one micro-batch only,
on every rank, or nowhere (then torch's AdamW skips it: no decay, no state, no step count;
its Adam step count then differs from the other parameters', which a per-unit counter gets
wrong). Float64 and rtol 1e-10 as every equivalence test (tinyscale.testing).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tinyscale as ts
from tinyscale.engine import checkpoint
from tinyscale.models import TinyMLP
from tinyscale.optim import build_optimizer
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks

WORLD, MICRO, ACCUM = 3, 2, 2
ROWS = WORLD * MICRO * ACCUM  # rank r holds rows 4r..4r+3; its micro-batch k rows 4r+2k, 4r+2k+1
# Rows that use `extra`, per step: rank 0's first micro-batch only; nowhere; ranks 1 and 2
# (each in one micro-batch); rank 1 only.
USES_EXTRA = [(1,), (), (5, 11), (6,)]
SAVE_AT = 2  # `extra` has stepped once by then, the others twice, `unused` never


class UnusedMLP(TinyMLP):
    """TinyMLP with `unused` (in no forward) and `extra` (applied to rows with x[:, 0] > 5)."""

    def __init__(self, seed: int = 0):
        super().__init__(seed=seed)
        self.extra = nn.Linear(16, 16, dtype=torch.float64)
        self.unused = nn.Linear(16, 16, dtype=torch.float64)
        self.reset_parameters(seed)

    def forward(self, x, y):
        h = torch.tanh(self.fc_in(x))
        h = torch.tanh(self.frozen(torch.tanh(self.shared(h))))
        h = torch.tanh(self.shared(h))
        rows = (x[:, 0] > 5).nonzero().flatten()
        if len(rows):  # only then is `extra` in the graph: a data-dependent branch
            h = h.index_add(0, rows, torch.tanh(self.extra(h[rows])))
        return torch.mean((h @ self.fc_in.weight + self.out_bias - y) ** 2)


def batches(steps: int = len(USES_EXTRA)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        x = torch.randn(ROWS, 8, generator=gen, dtype=torch.float64).clamp(-3, 3)
        x[list(USES_EXTRA[step]), 0] = 10.0
        out.append((x, torch.randn(ROWS, 8, generator=gen, dtype=torch.float64)))
    return out


def config(stage: int, world: int = WORLD, offload: str = "none", path: str | None = None, clip: float = 0.0):
    zero = {"stage": stage, "reduce_bucket_size": 300}  # several buckets / units at stages 0 and 2
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "nvme_path": path}
    return {"train_batch_size": ROWS, "train_micro_batch_size_per_gpu": ROWS // world // ACCUM,
            "gradient_accumulation_steps": ACCUM, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": zero}


def reference(steps: int, clip: float = 0.0):
    """One process: losses, parameters, and the optimizer state by name after `steps`."""
    model = UnusedMLP()
    cfg = ts.EngineConfig.load(config(0, 1, clip=clip))
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], cfg.optimizer)
    losses = [ts.reference.train_step(model, optimizer, b, cfg, s) for s, b in enumerate(batches()[:steps])]
    names = {p: n for n, p in model.named_parameters()}
    return losses, model.state_dict(), checkpoint.optimizer_state_by_name(optimizer, names)["state"]


def _train(stage, offload, path, clip, load_from=None):
    """Train the steps from SAVE_AT (if loading) or 0 to the end; save at SAVE_AT and at the end."""
    world = dist.get_world_size()
    cfg = config(stage, world, offload, path + "-swap", clip)
    # Stage 3: `unused` is a unit no rank ever gathers; `extra` stays in the root unit, since a
    # unit's all-gather is a collective that every rank must make (as in FSDP): a wrapped
    # module may not be skipped on some ranks only (lesson 02 says so).
    wrap = {"zero3_wrap": ["unused"]} if stage == 3 else {}
    engine = ts.initialize(UnusedMLP(seed=1 if load_from else 0), cfg, **wrap)
    if load_from:
        engine.load_checkpoint(load_from)
    losses = []
    for step in range(engine.step, len(USES_EXTRA)):
        losses.append(engine.train_batch(batches()[step]))
        if step + 1 == SAVE_AT and not load_from:
            engine.save_checkpoint(path + "-mid")
    engine.save_checkpoint(path + "-end")
    report = engine.memory_report()
    return losses, engine.full_state_dict(), report.bytes("optimizer_states")


def _check_state(saved: dict, expected: dict) -> None:
    assert sorted(saved) == sorted(expected), "parameters with optimizer state"  # `unused`: none
    for name, entry in expected.items():
        assert set(saved[name]) == set(entry), name
        for key, value in entry.items():
            if value.dim() == 0:
                assert saved[name][key] == value, f"{name} {key}"  # Adam's step: counts are exact
            else:
                assert_state_dicts_close({key: saved[name][key]}, {key: value}, what=f"optimizer state of {name}")


@pytest.mark.parametrize(("stage", "offload", "clip"), [(0, "none", 0.0), (1, "none", 0.05), (2, "nvme", 0.0),
                                                        (3, "none", 0.05), (3, "cpu", 0.0)],
                         ids=["zero0", "zero1-clip", "zero2-nvme", "zero3-clip", "zero3-cpu"])
def test_unused_parameters_train_as_one_process(tmp_path, stage, offload, clip):
    path = str(tmp_path / "ckpt")
    results = run_on_ranks(_train, WORLD, stage, offload, path, clip)
    ref_losses, ref_state, ref_opt = reference(len(USES_EXTRA), clip)
    for losses, state, _ in results:
        assert_losses_close(losses, ref_losses)
        assert_state_dicts_close(state, ref_state, what="parameters after training")
    assert torch.equal(results[0][1]["unused.weight"], UnusedMLP().state_dict()["unused.weight"])  # never decayed
    _check_state(checkpoint.read(path + "-end")[1]["state"], ref_opt)
    _check_state(checkpoint.read(path + "-mid")[1]["state"], reference(SAVE_AT, clip)[2])


@pytest.mark.parametrize(("save", "load"), [((3, 3), (1, 2)), ((2, 3), (3, 2))], ids=["zero3-to-zero1", "zero2-to-zero3"])
def test_unused_parameters_resume_in_another_layout(tmp_path, save, load):
    """A checkpoint taken when the step counts differ per parameter resumes exactly elsewhere."""
    path = str(tmp_path / "ckpt")
    run_on_ranks(_train, save[1], save[0], "none", path, 0.0)
    resumed = run_on_ranks(_train, load[1], load[0], "none", path + "-b", 0.0, path + "-mid")
    ref_losses, ref_state, ref_opt = reference(len(USES_EXTRA))
    for losses, state, _ in resumed:
        assert_losses_close(losses, ref_losses[SAVE_AT:])
        assert_state_dicts_close(state, ref_state, what="parameters after resuming")
    _check_state(checkpoint.read(path + "-b-end")[1]["state"], ref_opt)


def _direct(stage):
    """The stages without the engine: each agrees on usage with its own small all-reduce."""
    from tinyscale.zero import ZeroStage1, ZeroStage2, ZeroStage3

    model, rank = UnusedMLP(), dist.get_rank()
    cfg = ts.EngineConfig.load(config(stage))
    make = lambda groups: build_optimizer(groups, cfg.optimizer)  # noqa: E731
    params = [p for p in model.parameters() if p.requires_grad]
    zero = {1: lambda: ZeroStage1(params, make), 2: lambda: ZeroStage2(params, make, bucket_bytes=2400),
            3: lambda: ZeroStage3(params, make, module=model, wrap=["unused"])}[stage]()
    for x, y in batches():
        mine = slice(rank * MICRO * ACCUM, (rank + 1) * MICRO * ACCUM)
        for k in range(ACCUM):
            rows = slice(mine.start + k * MICRO, mine.start + (k + 1) * MICRO)
            (model(x[rows], y[rows]) / ACCUM).backward()
        zero.step()
    with zero.gathered() if stage == 3 else contextlib.nullcontext():
        return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [1, 2, 3], ids=["zero1", "zero2", "zero3"])
def test_unused_parameters_without_the_engine(stage):
    ref_state = reference(len(USES_EXTRA))[1]
    for state in run_on_ranks(_direct, WORLD, stage):
        assert_state_dicts_close(state, ref_state, what="parameters after training")


def _mixed(stage, precision):
    world = dist.get_world_size()
    # fp16: a small static scale, so that no step overflows and is skipped (those are tested elsewhere)
    cfg = {**config(stage, world), precision: {"enabled": True, **({"loss_scale": 8.0} if precision == "fp16" else {})}}
    engine = ts.initialize(UnusedMLP().float(), cfg, **({"zero3_wrap": ["unused"]} if stage == 3 else {}))
    for x, y in batches()[:3]:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16  # the model computes in it
        engine.train_batch((x.to(dtype), y.to(dtype)))
    names = {id(p): n for n, p in engine.model.named_parameters()}
    from tinyscale.zero.state_dict import gather_masters, gather_optimizer_state
    return (gather_masters(engine.zero.sharded, names)["unused.weight"],
            sorted(gather_optimizer_state(engine.zero.sharded, names)["state"]))


@pytest.mark.parametrize(("stage", "precision"), [(2, "bf16"), (3, "fp16")], ids=["zero2-bf16", "zero3-fp16"])
def test_unused_parameters_keep_their_fp32_masters_in_mixed_precision(stage, precision):
    """The fp32 master of a parameter no rank used is its initial value, bit for bit, and it
    has no optimizer state; the others do."""
    initial = UnusedMLP().unused.weight.float()
    for master, stepped in run_on_ranks(_mixed, WORLD, stage, precision):
        assert master.dtype == torch.float32 and torch.equal(master, initial)
        assert "unused.weight" not in stepped and "extra.weight" in stepped and "fc_in.weight" in stepped
