"""ZeRO-1 the PyTorch way (`tinyscale.zero.ZeroOptimizer`): the same training as one process
(float64) and as torch's ZeroRedundancyOptimizer under DDP, with tied, frozen and unused
parameters, world sizes 2 and 3; its state_dict loads at another world size and into a
plain optimizer. Run: `pytest -k zero_optimizer_api`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tinyscale as ts
from tests.zero.test_fully_shard import CONFIG_NAMES, OPTIMIZERS, _local_rows, _setup
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks
from tinyscale.zero import ZeroOptimizer


# --8<-- [start:pytorch-way]
def train_zero_optimizer(kind, seed, steps, micro, accum, optimizer, impl, start=0, resume=None, stop=None):
    """The PyTorch way, on every rank: (DDP,) an optimizer over model.parameters(), a loop.
    impl: "ddp" (ours under torch DDP), "torch" (ZeroRedundancyOptimizer under DDP) or
    "reduce" (ours without DDP, reduce_grads=True), "stage2" (that, reduced during backward;
    test_fully_shard's "mlp" has an unused
    layer, which torch DDP would refuse). `resume`: (params, optimizer state) after `start` steps;
    `stop`: train batches[start:stop] only (the data depend on `steps`, so it stays the same)."""
    model, batches = _setup(kind, seed, micro * accum * dist.get_world_size(), steps)
    if resume is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(resume[0][name])
    opt_class, kwargs = OPTIMIZERS[optimizer]
    if impl == "torch":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        wrapped = DDP(model)
        opt = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=opt_class, **kwargs)
    else:
        wrapped = DDP(model) if impl == "ddp" else model
        opt = ZeroOptimizer(wrapped.parameters(), opt_class, reduce_grads=impl != "ddp",
                            stage=2 if impl == "stage2" else 1, **kwargs)
    if resume is not None:
        opt.load_state_dict(resume[1])
    losses = []
    for batch in batches[start:stop]:
        total = 0.0
        for x, y in _local_rows(batch, micro, accum):
            loss = wrapped(x, y)
            (loss / accum).backward()
            total += loss.item() / accum
        opt.step()
        opt.zero_grad()
        losses.append(total)
    # --8<-- [end:pytorch-way]
    state = opt.state_dict() if impl != "torch" else None
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}, state


def _reference(kind, seed, steps, micro, accum, world, optimizer):
    _, kwargs = OPTIMIZERS[optimizer]
    config = {"train_batch_size": micro * accum * world, "train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": accum, "optimizer": {"type": CONFIG_NAMES[optimizer], "params": kwargs}}
    model, batches = _setup(kind, seed, micro * accum * world, steps)
    losses = ts.reference.train(model, batches, config)
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def _global_losses(results, world):
    # each rank's loss is its rows' mean; equal row counts, so their mean is the global mean
    return [sum(step) / world for step in zip(*(losses for losses, _, _ in results))]


@pytest.mark.parametrize(("kind", "world", "optimizer", "impl", "accum"), [
    ("gpt", 2, "adamw", "ddp", 1), ("gpt", 3, "sgd", "ddp", 1),
    ("mlp", 2, "sgd", "reduce", 2), ("mlp", 3, "adamw", "reduce", 2), ("gpt", 3, "adamw", "reduce", 1),
    ("mlp", 3, "adamw", "stage2", 2), ("gpt", 2, "sgd", "stage2", 2)])
def test_zero_optimizer_api_matches_single_process_float64(kind, world, optimizer, impl, accum):
    """Tied weights (both models), a frozen and an unused layer (mlp), uneven partitions."""
    results = run_on_ranks(train_zero_optimizer, world, kind, 5, 3, 1, accum, optimizer, impl)
    expected_losses, expected = _reference(kind, 5, 3, 1, accum, world, optimizer)
    for _, params, _ in results:
        assert_state_dicts_close(params, expected, what=f"ZeroOptimizer ({impl}) vs one process")
    assert_losses_close(_global_losses(results, world), expected_losses)


@pytest.mark.parametrize(("world", "optimizer"), [(2, "adamw"), (3, "sgd")])
def test_zero_optimizer_api_agrees_with_torch_zero_redundancy_optimizer(world, optimizer):
    ours = run_on_ranks(train_zero_optimizer, world, "gpt", 5, 3, 1, 1, optimizer, "ddp")
    theirs = run_on_ranks(train_zero_optimizer, world, "gpt", 5, 3, 1, 1, optimizer, "torch")
    for (_, a, _), (_, b, _) in zip(ours, theirs):
        # the same DDP gradients, the same elementwise steps on the same parameters: bit for bit
        unequal = [k for k in b if not torch.equal(a[k], b[k])]
        assert not unequal, f"ZeroOptimizer and ZeroRedundancyOptimizer differ in {unequal}"


def test_zero_optimizer_api_state_dict_loads_at_another_world_size():
    """Save after 2 steps on 3 ranks; the state equals a plain AdamW's in one process, and
    2 ranks that load it finish the third step as one process does."""
    saved = run_on_ranks(train_zero_optimizer, 3, "mlp", 5, 3, 1, 1, "adamw", "reduce", 0, None, 2)
    _, params, state = saved[0]
    for _, _, other in saved[1:]:  # every rank returns the whole state
        for i, s in state["state"].items():
            assert_state_dicts_close(other["state"][i], s, rtol=0, atol=0, what="state_dict across ranks")
    ref_model, batches = _setup("mlp", 5, 3, 3)
    opt_class, kwargs = OPTIMIZERS["adamw"]
    ref_opt = opt_class(ref_model.parameters(), **kwargs)
    for batch in batches[:2]:
        ref_model(*batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    expected = ref_opt.state_dict()
    assert state["param_groups"] == expected["param_groups"]
    assert sorted(state["state"]) == sorted(expected["state"])  # the unused layer has no state, as in torch
    for i, s in expected["state"].items():
        assert_state_dicts_close(state["state"][i], s, what=f"optimizer state of parameter {i}")
    # a plain optimizer loads it too, and the run continues at 2 ranks
    opt_class(ref_model.parameters(), **kwargs).load_state_dict(state)
    resumed = run_on_ranks(train_zero_optimizer, 2, "mlp", 5, 3, 1, 1, "adamw", "reduce", 2, (params, state))
    ref_model(*_setup("mlp", 5, 2, 3)[1][2]).backward()  # the third batch as 2 ranks x 1 row see it
    ref_opt.step()
    for _, p, _ in resumed:
        assert_state_dicts_close(p, dict(ref_model.named_parameters()), what="resumed at 2 ranks vs one process")


def test_zero_optimizer_api_rejects_an_optimizer_instance():
    model, _ = _setup("gpt", 0, 1, 1)
    with pytest.raises(TypeError, match="optimizer_class must be a torch.optim.Optimizer subclass"):
        ZeroOptimizer(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1), lr=0.1)


def _ledger_of_step():
    from tinyscale.dist import comm

    model, batches = _setup("mlp", 0, dist.get_world_size(), 1)
    opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, reduce_grads=True, lr=0.1)
    model(*_local_rows(batches[0], 1, 1)[0]).backward()
    with comm.record() as ledger:
        opt.step()
    return [(r.op, r.bytes) for r in ledger.rows], [opt.owner[id(p)] for p in model.parameters()]


def test_zero_optimizer_api_step_communication_matches_the_count():
    """reduce_grads=True on 3 ranks: one all-reduce of usage flags (fp32, one per trainable
    parameter), a reduce of each used gradient to its owner, a broadcast of each trainable
    parameter from its owner (float64: 8 bytes an element); the unused layer is not reduced."""
    rows, owners = run_on_ranks(_ledger_of_step, 3)[0]
    model, _ = _setup("mlp", 0, 1, 1)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    used = [p for n, p in trainable if not n.startswith("unused.")]
    assert rows[0] == ("all_reduce", 4 * len(trainable))
    assert [r for r in rows if r[0] == "reduce"] == [("reduce", 8 * p.numel()) for p in used]
    assert [r for r in rows if r[0] == "broadcast"] == [("broadcast", 8 * p.numel()) for _, p in trainable]
    assert len(rows) == 1 + len(used) + len(trainable)
    loads = [sum(p.numel() for p, o in zip(model.parameters(), owners) if o == r) for r in range(3)]
    assert max(loads) - min(loads) <= max(p.numel() for p in model.parameters())  # greedy: within one parameter


def test_zero_optimizer_api_add_param_group_and_state_dict_in_one_process():
    """No process group: ZeroOptimizer steps as the plain optimizer does, a group added later
    included, and their state_dicts are interchangeable."""
    model, batches = _setup("gpt", 2, 2, 2)
    reference, _ = _setup("gpt", 2, 2, 2)
    params, ref_params = list(model.parameters()), list(reference.parameters())
    opt = ZeroOptimizer(params[:3], torch.optim.AdamW, lr=1e-2, weight_decay=0.05)
    opt.add_param_group({"params": params[3:], "lr": 5e-3})
    ref = torch.optim.AdamW(ref_params[:3], lr=1e-2, weight_decay=0.05)
    ref.add_param_group({"params": ref_params[3:], "lr": 5e-3})
    for batch in batches:
        for m, o in ((model, opt), (reference, ref)):
            m(*batch).backward()
            o.step()
            o.zero_grad()
    assert_state_dicts_close(dict(model.named_parameters()), dict(reference.named_parameters()), rtol=0, atol=0,
                             what="ZeroOptimizer in one process vs AdamW")  # the same ops on one process: exact
    assert opt.state_dict()["param_groups"] == ref.state_dict()["param_groups"]
    opt.load_state_dict(ref.state_dict())


def _ledger_of_stage2_backward():
    from tinyscale.dist import comm

    model, batches = _setup("mlp", 0, dist.get_world_size(), 1)
    opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, reduce_grads=True, stage=2, lr=0.1)
    with comm.record() as ledger:
        model(*_local_rows(batches[0], 1, 1)[0]).backward()
    local = [n for n, p in model.named_parameters() if p.grad is not None]
    with comm.record() as at_step:
        opt.step()
    return [r.op for r in ledger.rows], local, [r.op for r in at_step.rows]


def test_zero_optimizer_api_stage2_reduces_during_backward():
    """Stage 2: every trainable gradient is reduced to its owner inside backward (the unused
    layer's as zeros, in the fixed order) and dropped there; step adds one usage all-reduce."""
    in_backward, kept, at_step = run_on_ranks(_ledger_of_stage2_backward, 2)[0]
    model, _ = _setup("mlp", 0, 1, 1)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert in_backward == ["reduce"] * len(trainable)
    assert kept == []  # no full gradient outlives its reduce
    assert at_step == ["all_reduce"] + ["broadcast"] * len(trainable)
