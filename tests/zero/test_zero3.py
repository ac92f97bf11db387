"""ZeRO stage 3 through the engine: the same training as one process (float64) and as FSDP2,
3 Psi of communication (1.5x DDP), the memory the formula says, one unit (plus one
prefetched) gathered at a time, and activation checkpointing recomputing through it."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import tinyscale as ts
from tests.zero.test_zero_stages import OPTIMIZERS, fragments, no_decay_on_biases
from tests.zero.test_zero_stages import _check as check_like_one_process
from tinyscale.data import synthetic_regression_batches, synthetic_token_batches
from tinyscale.models import GPT, GPTConfig, TinyMLP
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks
from tinyscale.zero import split_into_units
from tinyscale.zero.stage3 import assign_units, wrapped_module_names

# Model variants: TinyMLP as one root unit, or with `shared` (used twice per forward) and
# `frozen` (no trainable parameter, so no unit) wrapped; GPT with and without a tied head.
MODELS = {"mlp": None, "mlp-wrapped": ["shared", "frozen"], "gpt": None, "gpt-tied": None}


def _gpt_config(tie=False, n_layer=2):
    # d_model 20 and 5 heads: unit sizes that divide neither 3 nor 4 (padding exercised)
    return GPTConfig(vocab_size=256, max_seq_len=16, n_layer=n_layer, n_head=5, d_model=20, ffn_hidden=36,
                     tie_embeddings=tie)


def _setup(kind, seed, rows, steps):
    if kind.startswith("mlp"):
        return TinyMLP(seed=seed), synthetic_regression_batches(num_batches=steps, batch_size=rows, dim=8, seed=seed)
    return (GPT(_gpt_config(tie=kind == "gpt-tied"), seed=seed, dtype=torch.float64),
            synthetic_token_batches(num_batches=steps, batch_size=rows, seq_len=16, seed=seed))


def _config(micro, accum, world, clip, optimizer, stage=3):
    return {"train_batch_size": micro * accum * world, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accum, "gradient_clipping": clip, "optimizer": OPTIMIZERS[optimizer],
            "zero_optimization": {"stage": stage}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}


def _train(kind, seed, config, steps, grouped):
    rows = ts.EngineConfig.load(config).batch(dist.get_world_size()).train_batch_size
    model, batches = _setup(kind, seed, rows, steps)
    engine = ts.initialize(model, config, param_groups=no_decay_on_biases if grouped else None,
                           zero3_wrap=MODELS[kind])
    losses = [engine.train_batch(b) for b in batches]
    return losses, engine.full_state_dict(), engine.memory_report("before_step").as_dict(), engine.comm_ledger


def _check(kind, seed, config, steps, world, grouped):
    return check_like_one_process(kind, seed, config, steps, world, grouped, train=_train, setup=_setup)


@given(kind=st.sampled_from(sorted(MODELS)), world=st.sampled_from([2, 3, 4]), seed=st.integers(0, 2**16),
       micro=st.integers(1, 2), accum=st.integers(1, 3), clip=st.sampled_from([0.0, 0.05]),
       optimizer=st.sampled_from(sorted(OPTIMIZERS)), grouped=st.booleans())
def test_zero3_matches_single_process_float64(kind, world, seed, micro, accum, clip, optimizer, grouped):
    _check(kind, seed, _config(micro, accum, world, clip, optimizer), 3, world, grouped)


@pytest.mark.parametrize(("kind", "world"), [("gpt", 3), ("gpt-tied", 4), ("mlp-wrapped", 4)])
def test_zero3_gpt_with_padding_and_tied_head_matches_single_process_float64(kind, world):
    _check(kind, 3, _config(1, 2, world, 1.0, "sgd"), 3, world, True)


def test_zero3_in_one_process_matches_the_reference():
    """No process group: a group of one, shards are whole buffers (the same code path)."""
    config = _config(2, 2, 1, 0.05, "adamw")
    model, batches = _setup("mlp-wrapped", 5, 4, 3)
    engine = ts.initialize(model, config, zero3_wrap=MODELS["mlp-wrapped"])
    losses = [engine.train_batch(b) for b in batches]
    ref_model, _ = _setup("mlp-wrapped", 5, 4, 3)
    assert_losses_close(losses, ts.reference.train(ref_model, batches, config))
    assert_state_dicts_close(engine.full_state_dict(), ref_model.state_dict())


# --- agreement with PyTorch's own ZeRO-3: FSDP2 ----------------------------------------

def _fsdp2(seed, steps, micro):
    from torch.distributed.fsdp import fully_shard

    world, rank = dist.get_world_size(), dist.get_rank()
    model, batches = _setup("gpt", seed, micro * world, steps)
    for block in model.blocks:  # the same units as ours: each block, then the root
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    for batch in batches:
        x, y = (t[rank * micro:(rank + 1) * micro] for t in batch)
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.full_tensor().detach().cpu() if hasattr(v, "full_tensor") else v.detach().cpu()
            for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world", [2, 3])
def test_zero3_agrees_with_fsdp2_fully_shard(world):
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "optimizer": OPTIMIZERS["adamw"]}
    ours = run_on_ranks(_train, world, "gpt", 4, config, 3, False)
    theirs = run_on_ranks(_fsdp2, world, 4, 3, 2)
    for (_, state, _, _), fsdp_state in zip(ours, theirs):
        assert_state_dicts_close(state, fsdp_state, what="ours vs FSDP2 fully_shard")


# --- communication: 3 Psi, 1.5x DDP --------------------------------------------------

def _bus_bytes_per_step(kind, stage):
    world = dist.get_world_size()
    config = _config(2, 1, world, 0.0, "sgd", stage=stage)
    model, batches = _setup(kind, 0, 2 * world, 1)
    engine = ts.initialize(model, config)
    engine.comm_ledger.clear()  # drop the initial broadcast
    engine.train_batch(batches[0])
    rows = engine.comm_ledger.rows
    loss_row = [r for r in rows if r.op == "all_reduce"][-1]  # the loss, reduced after backward
    return sum(r.bus_bytes for r in rows if r is not loss_row), {op: engine.comm_ledger.calls(op) for op in
                                                                   ("all_gather", "reduce_scatter", "all_reduce")}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_zero3_moves_one_and_a_half_times_the_bytes_of_ddp(kind, world):
    model = _setup(kind, 0, 1, 1)[0]
    trainable = [p for p in model.parameters() if p.requires_grad]
    # units: each GPT block, and the root (everything else); TinyMLP: the root alone
    blocks = [list(b.parameters()) for b in model.blocks] if kind == "gpt" else []
    sizes = [sum(p.numel() for p in b) for b in blocks]
    sizes.append(sum(p.numel() for p in trainable) - sum(sizes))
    psi, padded = sum(sizes), sum(math.ceil(n / world) * world for n in sizes)
    ddp, _ = run_on_ranks(_bus_bytes_per_step, world, kind, 0)[0]
    zero3, calls = run_on_ranks(_bus_bytes_per_step, world, kind, 3)[0]
    ddp -= 2 * (world - 1) / world * 8 * len(trainable)  # its usage flags (one per parameter, in the last bucket)
    assert ddp == pytest.approx(2 * (world - 1) / world * 8 * psi)
    # all-gather in forward + all-gather in backward + reduce-scatter: 3 x (N-1)/N x padded Psi
    assert zero3 == pytest.approx(3 * (world - 1) / world * 8 * padded)
    assert zero3 == pytest.approx(1.5 * ddp * padded / psi)  # the paper's 1.5x, up to padding
    assert calls == {"all_gather": 2 * len(sizes), "reduce_scatter": len(sizes), "all_reduce": 1}


# --- memory: shards only, and one unit at a time -----------------------------------------

@pytest.mark.parametrize("world", [2, 3, 4])
def test_zero3_memory_report_equals_the_formula(world):
    config = _config(2, 1, world, 0.0, "adamw")
    # TinyMLP with wrap ["shared", "frozen"]: unit `shared` (256 + 16 elements) and the root
    # (fc_in 128 + 16, out_bias 8); `frozen` (272 elements) stays full on every rank.
    shard = math.ceil(272 / world) + math.ceil(152 / world)  # ceil(numel / N) per unit: padding included
    m = TinyMLP()
    units = (split_into_units([m.shared.weight, m.shared.bias], None, world, 0)
             + split_into_units([m.out_bias, m.fc_in.weight, m.fc_in.bias], None, world, 0))  # named_parameters() order
    # two steps: Adam creates its state lazily in the first, so the second step's snapshot has it all
    for rank, (_, _, memory, _) in enumerate(run_on_ranks(_train, world, "mlp-wrapped", 0, config, 2, False)):
        elements, pieces = fragments(units, rank)  # the parameter pieces in my shards
        expected = {
            "parameters": 8 * shard + 8 * 272,  # my parameter shards + the frozen layer
            "gradients": 8 * shard,
            "master_weights": 8 * shard,
            "optimizer_states": 2 * 8 * elements + 4 * pieces,  # exp_avg + exp_avg_sq, a float32 `step` per piece
        }
        assert {k: memory[k] for k in expected} == expected


def _residency():
    """Which units are gathered at every module's forward and every parameter's gradient."""
    model = GPT(_gpt_config(n_layer=4), seed=0, dtype=torch.float64)
    engine = ts.initialize(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}})
    zero, seen = engine.zero, []
    for u, unit in enumerate(zero.units):
        for module in unit.module.modules() if u != zero.root else []:
            module.register_forward_pre_hook(lambda m, a, u=u: seen.append(("forward", u, zero.materialized())))
        for p in unit.params:
            p.register_hook(lambda g, u=u: seen.append(("backward", u, zero.materialized())))
    batches = synthetic_token_batches(num_batches=2, batch_size=2 * dist.get_world_size(), seq_len=16, seed=0)
    for batch in batches:  # the second step prefetches in the order the first one recorded
        seen.clear()
        engine.train_batch(batch)
    return seen, [(kind, u) for kind, u, _ in zero.events], zero.root, zero.materialized()


def test_zero3_gathers_at_most_one_unit_plus_one_prefetched():
    seen, events, root, after = run_on_ranks(_residency, 2)[0]
    assert after == []  # between steps: shards only
    assert {u for _, u, _ in seen} == {0, 1, 2, 3, root}
    for phase, u, gathered in seen:
        blocks = set(gathered) - {root}
        # the unit running, plus at most the next one (forward) or the previous one
        # (backward) in flight; the root unit (embedding, norm, head) spans the whole pass
        neighbour = u + 1 if phase == "forward" else u - 1
        assert u in gathered and blocks <= {u, neighbour}, (phase, u, gathered)
        assert root in gathered
    forward = events[:events.index(("backward", root))]
    backward = events[events.index(("backward", root)):]
    for k in range(3):  # block k+1's all-gather was issued before block k finished (and was freed)
        assert forward.index(("prefetch", k + 1)) < forward.index(("free", k))
        assert backward.index(("prefetch", k)) < backward.index(("reduce_scatter", k + 1))
    assert ("gather", 1) not in events  # every block came from a prefetch


# --- activation checkpointing -----------------------------------------------------------

class _Checkpointed(nn.Module):
    """Runs `blocks` in sequence under one non-reentrant torch.utils.checkpoint region."""

    def __init__(self, *blocks):
        super().__init__()
        self.inner = nn.ModuleList(blocks)

    def forward(self, x, cos, sin):
        def run(x):
            for block in self.inner:
                x = block(x, cos, sin)
            return x
        return checkpoint(run, x, use_reentrant=False)


def _checkpointed_run(layout):
    """layout "none": plain blocks; "outside": units wrap the checkpointed call (recomputation
    runs inside an already gathered unit); "inside": checkpoint regions around the units;
    "span": one region over both blocks, so recomputing block 0 must gather it again."""
    model = GPT(_gpt_config(n_layer=2), seed=1, dtype=torch.float64)
    wrap = None
    if layout in ("outside", "inside"):
        model.blocks = nn.ModuleList(_Checkpointed(b) for b in model.blocks)
        wrap = ["blocks.0.inner.0", "blocks.1.inner.0"] if layout == "inside" else None
    elif layout == "span":
        model.blocks = nn.ModuleList([_Checkpointed(*model.blocks)])
        wrap = ["blocks.0.inner.0", "blocks.0.inner.1"]
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": 3}, "optimizer": OPTIMIZERS["sgd"]}
    engine = ts.initialize(model, config, zero3_wrap=wrap)
    batches = synthetic_token_batches(num_batches=2, batch_size=4 * dist.get_world_size(), seq_len=16, seed=1)
    losses = [engine.train_batch(b) for b in batches]
    return losses, list(engine.full_state_dict().values()), engine.comm_ledger.calls("all_gather")


def test_zero3_activation_checkpointing_recomputes_bitwise_the_same():
    plain = run_on_ranks(_checkpointed_run, 2, "none")
    for layout in ("outside", "inside", "span"):
        for (losses, params, gathers), (ref_losses, ref_params, ref_gathers) in zip(
                run_on_ranks(_checkpointed_run, 2, layout), plain):
            assert losses == ref_losses
            assert all(torch.equal(a, b) for a, b in zip(params, ref_params)), layout
            # "span": block 0 is recomputed before its backward, so it is gathered again
            # (once per micro-batch: 2 steps x 2 micro-batches); otherwise no extra gather
            assert gathers == ref_gathers + (4 if layout == "span" else 0), layout


# --- recovery and units ----------------------------------------------------------------

def _backward_raises_then_recovers():
    config = _config(2, 1, dist.get_world_size(), 0.0, "sgd")
    model, batches = _setup("gpt", 2, 2 * dist.get_world_size(), 3)
    engine = ts.initialize(model, config)
    # An error in the middle of backward (as out-of-memory would be), on every rank: the
    # blocks' gradients are already reduce-scattered and the root is still gathered.
    handle = model.embed.weight.register_hook(lambda g: (_ for _ in ()).throw(MemoryError("simulated")))
    with contextlib.suppress(MemoryError):
        engine.train_batch(batches[0])
    handle.remove()
    return [engine.train_batch(b) for b in batches[1:]], engine.full_state_dict()


def test_zero3_recovers_after_a_backward_that_raised():
    results = run_on_ranks(_backward_raises_then_recovers, 2)
    model, batches = _setup("gpt", 2, 4, 3)
    ref = ts.reference.train(model, batches[1:], _config(2, 1, 2, 0.0, "sgd"))
    for losses, state in results:  # nothing of the failed step leaks into the next ones
        assert_losses_close(losses, ref)
        assert_state_dicts_close(state, model.state_dict())


def test_zero3_units_default_to_module_list_elements_and_tied_weights_go_to_the_root():
    gpt = GPT(_gpt_config(tie=True, n_layer=3))
    names = wrapped_module_names(gpt)
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    owner = assign_units(gpt, names)
    assert owner[id(gpt.embed.weight)] == owner[id(gpt.head.weight)] == owner[id(gpt.norm.weight)] == 3
    assert owner[id(gpt.blocks[1].attn.wq.weight)] == 1
    mlp = TinyMLP()
    assert wrapped_module_names(mlp) == []  # no ModuleList: one root unit
    assert wrapped_module_names(mlp, lambda name, m: name == "shared") == ["shared"]
    owner = assign_units(mlp, ["shared", "frozen"])
    assert owner[id(mlp.shared.weight)] == 0 and id(mlp.frozen.weight) not in owner  # frozen: in no unit
    # a weight held by two wrapped modules (tied across units) belongs to the root
    gpt_untied = GPT(_gpt_config())
    gpt_untied.head.weight = gpt_untied.embed.weight
    assert assign_units(gpt_untied, ["embed", "head"])[id(gpt_untied.embed.weight)] == 2
    with pytest.raises(ValueError, match=r"no submodule named \['blocks.9'\]"):
        wrapped_module_names(gpt, ["blocks.9"])
