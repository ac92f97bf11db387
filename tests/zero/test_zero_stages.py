"""ZeRO stages 1 and 2 through the engine: the same training as one process (float64), the
memory the formulas say, and the bytes of DDP."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import tinyscale as ts
from tinyscale.data import synthetic_regression_batches, synthetic_token_batches
from tinyscale.models import GPT, GPTConfig, TinyMLP
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks
from tinyscale.zero import split_into_units

OPTIMIZERS = {  # SGD too: Adam hides a uniform gradient-scale bug (see tests/data_parallel)
    "adamw": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}},
    "sgd": {"type": "SGD", "params": {"lr": 5e-2, "momentum": 0.9, "weight_decay": 0.01}},
}


def no_decay_on_biases(model):
    """Two parameter groups with different hyperparameters, as trainers usually do."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def _setup(kind, seed, rows, steps):
    if kind == "mlp":
        return TinyMLP(seed=seed), synthetic_regression_batches(num_batches=steps, batch_size=rows, dim=8, seed=seed)
    # d_model 20 and 5 heads: parameter counts that divide neither 3 nor 4 (padding exercised)
    cfg = GPTConfig(vocab_size=256, max_seq_len=16, n_layer=2, n_head=5, d_model=20, ffn_hidden=36)
    return (GPT(cfg, seed=seed, dtype=torch.float64),
            synthetic_token_batches(num_batches=steps, batch_size=rows, seq_len=16, seed=seed))


def _config(stage, micro, accum, world, clip, optimizer, bucket=500_000_000):
    """`bucket` is reduce_bucket_size, in elements as in DeepSpeed (8 bytes each here)."""
    return {"train_batch_size": micro * accum * world, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accum, "gradient_clipping": clip, "optimizer": OPTIMIZERS[optimizer],
            "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}


def _train(kind, seed, config, steps, grouped):
    rows = ts.EngineConfig.load(config).batch(dist.get_world_size()).train_batch_size
    model, batches = _setup(kind, seed, rows, steps)
    engine = ts.initialize(model, config, param_groups=no_decay_on_biases if grouped else None)
    losses = [engine.train_batch(b) for b in batches]
    return losses, engine.full_state_dict(), engine.memory_report("before_step"), engine.comm_ledger


def _check(kind, seed, config, steps, world, grouped, *, train=None, setup=None):
    """Train on `world` ranks (`train`, default `_train`), compare with one process and across
    ranks; stage 3's tests pass their own train and setup (model variants, units)."""
    train, setup = train or _train, setup or _setup
    results = run_on_ranks(train, world, kind, seed, config, steps, grouped)
    model, batches = setup(kind, seed, ts.EngineConfig.load(config).train_batch_size, steps)
    ref = ts.reference.train(model, batches, config, param_groups=no_decay_on_biases if grouped else None)
    for losses, state, _, _ in results:
        assert_losses_close(losses, ref)
        assert_state_dicts_close(state, model.state_dict(), what="parameters after training")
    for _, state, _, _ in results[1:]:  # gathered from the same shards: bitwise equal on every rank
        assert all(torch.equal(state[k], results[0][1][k]) for k in state)
    return results


def _property_setup(kind, seed, rows, steps, uses):
    """The GPT, or TinyMLP with a layer no forward uses and one used by the rows in `uses[step]`."""
    if kind == "gpt":
        return _setup("gpt", seed, rows, steps)
    from tests.zero.test_unused import UnusedMLP

    batches = []
    for step, (x, y) in enumerate(synthetic_regression_batches(num_batches=steps, batch_size=rows, dim=8, seed=seed)):
        x = x.clamp(-3, 3)
        x[[r % rows for r in uses[step]], 0] = 10.0  # these rows use UnusedMLP.extra
        batches.append((x, y))
    return UnusedMLP(seed=seed), batches


def _property_train(kind, seed, config, steps, grouped, uses, fail):
    """Train; at `fail` = (step, "one" or "all", micro-batch) that forward raises, and the step is retried."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model, batches = _property_setup(kind, seed, ts.EngineConfig.load(config).batch(world).train_batch_size,
                                     steps, uses)
    engine = ts.initialize(model, config, param_groups=no_decay_on_biases if grouped else None)
    calls, trap = [0], [None]

    def forward_pre_hook(module, args):
        calls[0] += 1
        if calls[0] == trap[0]:
            raise MemoryError("simulated")
    model.register_forward_pre_hook(forward_pre_hook)
    losses = []
    for step, batch in enumerate(batches):
        if fail[0] == step:
            if fail[1] == "all" or rank == world - 1:
                trap[0] = calls[0] + fail[2] % engine.batch.gradient_accumulation_steps + 1
            with pytest.raises((MemoryError, ts.engine.StepFailed)):
                engine.train_batch(batch)
            trap[0] = None
        losses.append(engine.train_batch(batch))
    return losses, engine.full_state_dict()


# The main property (stages 1, 2 and 3): every example has a parameter no rank uses, one used by drawn rows (so
# on some ranks, micro-batches and steps only) and a forward that raises on one or every
# rank; the GPT brings padding and several units. Each reintroduced bug of issues 10 and 19
# (unused parameters stepped, a failed step's gradients kept) fails every example.
@pytest.mark.parametrize("stage", [1, 2, 3], ids=["zero1", "zero2", "zero3"])
@given(world=st.sampled_from([2, 3, 4]), seed=st.integers(0, 2**16), micro=st.integers(1, 2),
       accum=st.integers(1, 3), clip=st.sampled_from([0.0, 0.05]), optimizer=st.sampled_from(sorted(OPTIMIZERS)),
       grouped=st.booleans(), bucket=st.sampled_from([40, 250, 500_000_000]), kind=st.sampled_from(["mlp", "mlp", "gpt"]),
       uses=st.lists(st.sets(st.integers(0, 23), max_size=2), min_size=3, max_size=3),
       fail=st.tuples(st.integers(0, 2), st.sampled_from(["one", "all"]), st.integers(0, 2)))
def test_zero_matches_single_process_float64(stage, world, seed, micro, accum, clip, optimizer, grouped, bucket,
                                             kind, uses, fail):
    config = _config(stage, micro, accum, world, clip, optimizer, bucket)
    if stage == 3 and fail[0] == 0 and fail[2] % accum == 0:
        # Stage 3 cannot release the other ranks from a failure on one rank in the very first
        # micro-batch (its sequence of gathers is learnt from a completed one): every rank fails there.
        fail = (0, "all", 0)
    results = run_on_ranks(_property_train, world, kind, seed, config, 3, grouped, uses, fail)
    model, batches = _property_setup(kind, seed, ts.EngineConfig.load(config).train_batch_size, 3, uses)
    ref = ts.reference.train(model, batches, config, param_groups=no_decay_on_biases if grouped else None)
    for losses, state in results:
        assert_losses_close(losses, ref)
        assert_state_dicts_close(state, model.state_dict(), what="parameters after training")


@pytest.mark.parametrize("stage", [1, 2], ids=["zero1", "zero2"])
@pytest.mark.parametrize("world", [3, 4])
def test_zero_gpt_with_padding_matches_single_process_float64(stage, world):
    _check("gpt", 3, _config(stage, 1, 2, world, 1.0, "adamw", bucket=500), 3, world, True)


def fragments(units, rank):
    """(elements, count) of the parameter pieces inside `rank`'s shards: the optimizer steps
    one tensor per piece, so padding has no state and every piece has its own `step`."""
    elements = count = 0
    for u in units:
        lo, hi = u.shard_numel * rank, u.shard_numel * (rank + 1)
        start = 0
        for p in u.params:
            inside = max(0, min(hi, start + p.numel()) - max(lo, start))
            elements, count, start = elements + inside, count + (inside > 0), start + p.numel()
    return elements, count


def _expected_memory(stage, world, bucket, rank):
    """The per-rank model-state bytes of our implementation, from the formulas (float64 = 8 B)."""
    model = TinyMLP()
    trainable = [p for p in model.parameters() if p.requires_grad]
    units = split_into_units(trainable, 8 * bucket, world, 0, reverse=True)  # reduce_bucket_size, in elements
    shard = sum(u.shard_numel for u in units)  # sum over units of ceil(numel / N): padding included
    psi = sum(p.numel() for p in model.parameters())  # frozen ones are parameters too
    elements, pieces = fragments(units, rank)
    return {
        "parameters": 8 * psi,
        # shards only: stage 1's last backward reduced its full gradients (held between micro-batches)
        "gradients": 8 * shard,
        "master_weights": 8 * shard,
        # exp_avg + exp_avg_sq, and Adam's float32 `step` per stepped tensor
        "optimizer_states": 2 * 8 * elements + pieces * torch.tensor(0.0).element_size(),
    }


@pytest.mark.parametrize("stage", [1, 2], ids=["zero1", "zero2"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_zero_memory_report_equals_the_formula(stage, world):
    config = _config(stage, 2, 1, world, 0.0, "adamw", bucket=250)
    # two steps: Adam creates its state lazily in the first, so the second step's snapshot has it all
    for rank, (_, _, report, _) in enumerate(run_on_ranks(_train, world, "mlp", 0, config, 2, False)):
        expected = _expected_memory(stage, world, 250, rank)
        got = report.as_dict()
        assert {k: got[k] for k in expected} == expected


def _bus_bytes_per_step(stage, world):
    config = _config(stage, 2, 1, world, 0.0, "sgd", bucket=250)
    rows = ts.EngineConfig.load(config).train_batch_size
    model, batches = _setup("mlp", 0, rows, 1)
    engine = ts.initialize(model, config)
    engine.comm_ledger.clear()  # drop the initial broadcast
    engine.train_batch(batches[0])
    rows = engine.comm_ledger.rows
    loss_row = [r for r in rows if r.op == "all_reduce"][-1]  # the loss, reduced after backward
    moved = sum(r.bus_bytes for r in rows if r is not loss_row)
    return moved, sum(r.op == "all_reduce" for r in rows) if stage else None


@pytest.mark.parametrize("world", [2, 4])
def test_zero_move_the_same_bytes_as_ddp(world):
    psi_bytes = 8 * sum(p.numel() for p in TinyMLP().parameters() if p.requires_grad)
    padded = {s: 8 * sum(u.padded_numel for u in split_into_units(
        [p for p in TinyMLP().parameters() if p.requires_grad], 8 * 250, world, 0, reverse=True))
        for s in (1, 2)}
    ring = 2 * (world - 1) / world
    flags = 8 * len([p for p in TinyMLP().parameters() if p.requires_grad])  # DDP's usage flags, one per parameter
    ddp, _ = run_on_ranks(_bus_bytes_per_step, world, 0, world)[0]
    assert ddp == pytest.approx(ring * (psi_bytes + flags))
    for stage in (1, 2):
        zero, loss_allreduces = run_on_ranks(_bus_bytes_per_step, world, stage, world)[0]
        # reduce-scatter (N-1)/N + all-gather (N-1)/N of the padded gradient: DDP's 2(N-1)/N,
        # plus only the padding (at most N-1 elements per unit)
        assert zero == pytest.approx(ring * padded[stage])
        assert loss_allreduces == 1


def _stage2_launches():
    cfg = GPTConfig.preset("tiny")
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "reduce_bucket_size": 2_500}}
    engine = ts.initialize(GPT(cfg, seed=0, dtype=torch.float64), config)
    batch = synthetic_token_batches(num_batches=1, batch_size=2 * dist.get_world_size(), seq_len=16, seed=0)[0]
    engine.train_batch(batch)
    events = engine.zero.events
    end = next(t for kind, _, t in events if kind == "backward_end")
    return [t < end for kind, _, t in events if kind == "launch"], engine.memory_report("before_step").as_dict()


def test_zero2_reduce_scatters_during_backward_and_never_holds_the_full_gradient():
    psi_bytes = 8 * sum(p.numel() for p in GPT(GPTConfig.preset("tiny")).parameters())
    for before_end, memory in run_on_ranks(_stage2_launches, 2):
        assert len(before_end) > 1 and before_end[0]  # the first bucket went out while backward ran
        # a shard per bucket, ceil(numel / 2) each: half the gradient plus at most one element per bucket
        assert memory["gradients"] <= psi_bytes / 2 + 8 * len(before_end)


def _torch_zero_redundancy(seed, steps, world_micro):
    """torch's own stage 1: DDP for the gradients, ZeroRedundancyOptimizer for the sharded step."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    world, rank = dist.get_world_size(), dist.get_rank()
    model, batches = _setup("mlp", seed, world_micro * world, steps)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer([p for p in model.parameters() if p.requires_grad],
                                  optimizer_class=torch.optim.AdamW, lr=1e-2, weight_decay=0.05)
    for batch in batches:
        x, y = (t[rank * world_micro:(rank + 1) * world_micro] for t in batch)
        ddp(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ts.testing.state_dict_cpu(model)


@pytest.mark.parametrize("world", [2, 3])
def test_zero1_agrees_with_torch_zero_redundancy_optimizer(world):
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}, "optimizer": OPTIMIZERS["adamw"]}
    ours = run_on_ranks(_train, world, "mlp", 4, config, 3, False)
    theirs = run_on_ranks(_torch_zero_redundancy, world, 4, 3, 2)
    for (_, state, _, _), torch_state in zip(ours, theirs):
        assert_state_dicts_close(state, torch_state, what="ours vs ZeroRedundancyOptimizer")


def _flat_buffer_run(stage):
    """Two steps of 2 accumulated micro-batches on 2 ranks; FlatUnit.flatten raises from the
    first backward on (the gradients must already sit in the flat buffers)."""
    from tinyscale.zero import ZeroStage1, ZeroStage2
    from tinyscale.zero.flat import FlatUnit

    rank = dist.get_rank()
    model, batches = _setup("gpt", 0, 8, 2)
    make = lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05)  # noqa: E731
    zero = ZeroStage1(model.parameters(), make) if stage == 1 else ZeroStage2(model.parameters(), make,
                                                                              bucket_bytes=8 * 3000)
    original = FlatUnit.flatten
    FlatUnit.flatten = lambda *a, **k: (_ for _ in ()).throw(AssertionError("flattened a copy"))
    try:  # (the rank processes are reused by the next test: put flatten back)
        return _train_two_steps(stage, model, batches, zero, rank)
    finally:
        FlatUnit.flatten = original


def _train_two_steps(stage, model, batches, zero, rank):
    views = []
    for x, y in batches:
        for micro in range(2):
            rows = slice(4 * rank + 2 * micro, 4 * rank + 2 * micro + 2)
            with zero.no_sync() if stage == 1 and micro == 0 else contextlib.nullcontext():
                (model(x[rows], y[rows]) / 2).backward()
            flat = zero.grad_flat if stage == 1 else []
            views.append([any(p.grad is not None and p.grad.data_ptr() == b.data_ptr() + 8 * u.offsets[i]
                              for b, u in zip(flat, zero.sharded.units) for i, q in enumerate(u.params) if q is p)
                          for p in model.parameters()])
        zero.step()
    return ts.testing.state_dict_cpu(model), views, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_gradients_live_in_the_flat_buffer_no_flattening_copy(stage):
    """Stages 1 and 2 send each unit's gradients from the flat buffer they were put in when
    backward produced them (stage 1: .grad is a view of its slot, the next micro-batch (under
    no_sync) adds into it, the last backward sends the buffer; stage 2: .grad is freed into the bucket): nothing is flattened before a reduce-scatter,
    and the float64 result is one process's."""
    (ours, views, grads), *_ = run_on_ranks(_flat_buffer_run, 2, stage)
    model, batches = _setup("gpt", 0, 8, 2)  # one process: the same 8 rows a step, the same sums
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    for x, y in batches:
        for micro in range(2):
            for rank in range(2):
                rows = slice(4 * rank + 2 * micro, 4 * rank + 2 * micro + 2)
                (model(x[rows], y[rows]) / 4).backward()  # / 2 micro-batches / 2 ranks (their average)
        opt.step()
        opt.zero_grad()
    assert_state_dicts_close(ours, ts.testing.state_dict_cpu(model))  # float64 default tolerance
    assert all(g is None for g in grads)  # after the step: no full gradient held by .grad
    if stage == 1:  # every .grad a view of its slot after a no_sync backward; the last one sent them all
        assert all(all(v) for v in views[0::2]) and not any(any(v) for v in views[1::2])
    else:
        assert not any(any(v) for v in views)  # stage 2: no .grad kept after backward



def _two_layers():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4, dtype=torch.float64), torch.nn.Linear(4, 4, dtype=torch.float64)


def _grad_set_outside_backward_run():
    """Rank 1's backward reaches only the second layer, whose unit goes first; the first layer's
    unit (bias first, then weight, backward's order) gets no gradient from a hook there, and its
    weight a .grad set before backward. torch.empty's memory is arbitrary: here it is NaN."""
    from tinyscale.zero import ZeroStage1

    rank = dist.get_rank()
    a, b = _two_layers()
    params = [*a.parameters(), *b.parameters()]
    zero = ZeroStage1(params, lambda groups: torch.optim.SGD(groups, lr=1.0), bucket_bytes=160)
    assert [u.params for u in zero.sharded.units] == [[b.bias, b.weight], [a.bias, a.weight]]
    x = torch.arange(8, dtype=torch.float64).view(2, 4) / 8 + rank
    empty = torch.empty
    torch.empty = lambda *args, **kwargs: empty(*args, **kwargs).fill_(float("nan"))
    try:
        if rank == 0:
            b(a(x)).sum().backward()
        else:
            a.weight.grad = torch.ones(4, 4, dtype=torch.float64)
            b(x).sum().backward()
    finally:
        torch.empty = empty
    zero.step()
    return [p.detach().clone() for p in params]


def test_zero1_unit_without_hook_gradients_sends_zeros_and_the_grad_set_outside_backward():
    """ZeroStage1: a unit none of whose gradients came through a hook in the reducing backward
    is sent as zeros plus whatever .grad holds (set outside backward): no slot of its flat
    buffer left as torch.empty made it (rank 1 here, its first layer's bias: rank 0's gradient
    for it must be averaged with zero, not with garbage)."""
    results = run_on_ranks(_grad_set_outside_backward_run, 2)
    a, b = _two_layers()
    params = [*a.parameters(), *b.parameters()]
    grads = [torch.zeros_like(p) for p in params]
    for rank in range(2):
        x = torch.arange(8, dtype=torch.float64).view(2, 4) / 8 + rank
        (b(a(x)) if rank == 0 else b(x)).sum().backward()
        if rank == 1:
            a.weight.grad = torch.ones(4, 4, dtype=torch.float64)  # what rank 1 sets (its backward skips a)
        for g, p in zip(grads, params):
            g += 0 if p.grad is None else p.grad
            p.grad = None
    expected = [p.detach() - g / 2 for p, g in zip(params, grads)]  # SGD, lr 1, the mean over 2 ranks
    for ours in results:
        for got, want in zip(ours, expected):
            # exact: the same two float64 terms, halved (exact in binary) before or after their sum
            torch.testing.assert_close(got, want, rtol=0, atol=0)
