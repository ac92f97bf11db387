"""Zero-bubble's W runs the parameters' post-accumulate-grad hooks as a plain backward does
(`tinyscale.pipeline.split_backward`): once per W, after .grad holds the gradient, and the whole W
is one backward, so what a hook queues for the end of backward runs once. Data-parallel wrappers
that reduce in those hooks (BucketedDDP, ZeroOptimizer stage 2) under a ZB-H1 executor driven by
hand, outside the engine, then train like one process (pp 2 x dp 2, float64). Run:
`pytest tests/pipeline -k zb_hooks`."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tinyscale as ts
from tinyscale.data import local_micro_batches, synthetic_token_batches
from tinyscale.data_parallel import BucketedDDP
from tinyscale.dist import ParallelMesh
from tinyscale.models import GPT, GPTConfig
from tinyscale.pipeline.executor import GPTStage, PipelineExecutor, exchange_tied_grads, gpt_loss
from tinyscale.pipeline.partition import partition_gpt, stages_on_rank
from tinyscale.pipeline.schedules import add_communication, zb_h1
from tinyscale.pipeline.split_backward import backward_input, backward_weight, post_accumulate_grad_hooks
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks
from tinyscale.zero import ZeroOptimizer
from tests.pipeline.test_audit_split_backward import Summed

# float64 (eps 2.2e-16): the same products as one process, only the order of a few sums differs
# (the dp mean, the micro-batch sum); the errors stay ~1e-14 relative over these few steps
RTOL = 1e-10


# Two weights on one path and a gate read through its sum (three W groups, one stride-0 gradient)
Net = Summed


def _watch(module: nn.Module) -> list:
    """Record every hook call: (name, a copy of .grad then) and an 'end' per end of backward."""
    seen: list = []
    queued = [False]

    def hook(name, p):
        seen.append((name, p.grad.clone()))
        if not queued[0]:  # as DDP does: finish once, when the whole backward is done
            queued[0] = True
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: (seen.append(("end", None)), queued.__setitem__(0, False)))

    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: hook(name, p))
    return seen


def _inputs(m: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randn(4, 5, generator=g, dtype=torch.float64) for _ in range(m)]


def _by_name(seen: list) -> tuple[dict, int]:
    calls: dict[str, list] = {}
    for name, grad in seen:
        if name != "end":
            calls.setdefault(name, []).append(grad)
    return calls, sum(name == "end" for name, _ in seen)


def _check_like_plain(split: list, plain: list, m: int, what: str) -> None:
    (got, got_ends), (want, want_ends) = _by_name(split), _by_name(plain)
    assert (got_ends, want_ends) == (m, m), f"{what}: ends of backward {got_ends}, a plain backward {want_ends}"
    assert {k: len(v) for k, v in got.items()} == {k: m for k in want}, f"{what}: hook calls per parameter"
    for k in want:
        for i, (a, b) in enumerate(zip(got[k], want[k])):  # the accumulated .grad at each call
            assert_state_dicts_close({k: a}, {k: b}, rtol=RTOL, what=f"{what}: {k}.grad at hook call {i}")
    # the end of each backward comes after all of its hook calls, never between two of one W
    ends = [i for i, (name, _) in enumerate(split) if name == "end"]
    assert ends == [(j + 1) * (len(want) + 1) - 1 for j in range(m)], f"{what}: ends at {ends}"


def test_pp_zb_hooks_later_stage_w_fires_each_hook_once_with_the_accumulated_grad_float64():
    """B, B, B then W, W, W (zb_h1's order on its last stage), a tensor hook doubling w's gradient too:
    each post-accumulate hook fires once per W, seeing the .grad a plain backward's hook sees."""
    m = 3

    def run(split: bool) -> list:
        module = Net()
        module.w.register_hook(lambda g: 2 * g)
        seen, kept = _watch(module), []
        for x in _inputs(m):
            x = x.clone().requires_grad_()
            loss = module(x).square().sum()
            if split:
                kept.append(backward_input(loss, None, x, list(module.parameters()))[1])
            else:
                loss.backward()
        for k in kept:
            backward_weight(k)
        return seen

    _check_like_plain(run(True), run(False), m, "later stage's W")


def test_pp_zb_hooks_first_stage_w_fires_each_hook_once_with_the_accumulated_grad_float64():
    """The executor's W on stage 0 (p = 1: B does nothing there, W is the whole backward)."""
    m = 3
    module, plain_module = Net(), Net()
    split, plain = _watch(module), _watch(plain_module)
    PipelineExecutor(add_communication(zb_h1(1, m)), 0, {0: module},
                     loss_fn=lambda out, _: out.square().sum()).run(_inputs(m), [None] * m)
    for x in _inputs(m):
        (plain_module(x).square().sum() / m).backward()  # the executor's seed is 1 / m
    _check_like_plain(split, plain, m, "first stage's W")


def test_pp_zb_hooks_torch_keeps_post_accumulate_hooks_where_w_reads_them():
    """W reads the hooks from a private attribute of torch's; this fails if torch moves them."""
    p = nn.Parameter(torch.zeros(2))
    assert post_accumulate_grad_hooks(p) == []
    first, second = (lambda q: None), (lambda q: None)
    p.register_post_accumulate_grad_hook(first)
    handle = p.register_post_accumulate_grad_hook(second)
    assert post_accumulate_grad_hooks(p) == [first, second]
    handle.remove()
    assert post_accumulate_grad_hooks(p) == [first]


def _setup(steps: int, rows: int, tied: bool):
    cfg = GPTConfig(vocab_size=64, max_seq_len=8, n_layer=3, n_head=4, n_kv_head=2, d_model=16, ffn_hidden=24,
                    tie_embeddings=tied)
    return (GPT(cfg, seed=5, dtype=torch.float64),
            synthetic_token_batches(num_batches=steps, batch_size=rows, seq_len=8, vocab_size=64, seed=5))


SGD = {"lr": 5e-2, "momentum": 0.9, "weight_decay": 0.01}


def train_zb_dp(wrapper: str, tied: bool, m: int, steps: int, schedule=zb_h1):
    """pp 2 x dp 2: each rank's stage under `wrapper` over dp, ZB-H1 over pp, one step per batch."""
    mesh = ParallelMesh(pp=2, dp=2)
    pp_group, dp_group = mesh.group("pp"), mesh.group("dp")
    ranks = dist.get_process_group_ranks(pp_group)
    me = ranks.index(dist.get_rank())
    dp_rank = dist.get_process_group_ranks(dp_group).index(dist.get_rank())
    model, batches = _setup(steps, 2 * 2 * m, tied)
    (spec,) = stages_on_rank(partition_gpt(model.config, 2), me)
    stage = GPTStage(model, spec)
    params = list(stage.parameters())
    if wrapper == "bucketed_ddp":  # reduces in its hooks, finishes at the end of backward
        module = BucketedDDP(stage, process_group=dp_group, bucket_cap_mb=0.002)  # several buckets
        optimizer = torch.optim.SGD(params, **SGD)
    else:  # ZeroOptimizer stage 2: reduces to each owner in its hooks, zeros for the rest at the end;
        module = stage  # under no_sync it keeps .grad for step() to reduce, after the tied exchange
        optimizer = ZeroOptimizer(params, torch.optim.SGD, process_group=dp_group, reduce_grads=True, stage=2,
                                  **SGD)
    executor = PipelineExecutor(add_communication(schedule(2, m)), me, {me: module}, loss_fn=gpt_loss,
                                ranks=ranks, group=pp_group)
    losses = []
    for batch in batches:
        micro = local_micro_batches(batch, dp_rank=dp_rank, dp_size=2, micro_batch_size=2)
        with optimizer.no_sync() if wrapper.endswith("no_sync") else contextlib.nullcontext():
            loss = executor.run([ids for ids, _ in micro], [t for _, t in micro])
        if tied:
            exchange_tied_grads(model.embed.weight, ranks[1 - me], group=pp_group)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(None if loss is None else loss.item())
    mine = {id(q) for q in params}
    return losses, {k: q.detach().clone() for k, q in model.named_parameters() if id(q) in mine}


# ZeroOptimizer stage 2 drops .grad after each backward's reduce (the owner keeps the sum apart until
# step), so a table tied across stages has no gradient to exchange after the schedule: untied there,
# tied under no_sync (the reduces wait for step()); tied without it, step() raises (test below).
@pytest.mark.parametrize(("wrapper", "tied"), [("bucketed_ddp", True), ("zero_optimizer_stage2", False),
                                               ("zero_optimizer_stage2_no_sync", True)])
def test_pp_zb_hooks_dp_wrapper_reducing_in_hooks_matches_single_process_float64(wrapper, tied):
    """GQA, 3 layers on 2 stages, SGD with momentum and weight decay; DDP's embedding tied (on both stages)."""
    m, steps = 3, 2
    results = run_on_ranks(train_zb_dp, 4, wrapper, tied, m, steps)
    model, batches = _setup(steps, 2 * 2 * m, tied)
    config = {"train_batch_size": 4 * m, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2 * m,
              "optimizer": {"type": "SGD", "params": SGD}}
    expected_losses = ts.reference.train(model, batches, config)
    expected = {k: q.detach() for k, q in model.named_parameters()}
    for losses, state in results:  # every rank holds its whole stage, the same on both dp ranks
        assert_state_dicts_close(state, {k: expected[k] for k in state}, rtol=RTOL, what=f"{wrapper} over zb_h1")
        if losses[0] is not None:  # the last stage: the mean over its dp rank's rows
            assert len(losses) == steps
    last = [losses for losses, _ in results if losses[0] is not None]
    assert len(last) == 2
    mean = [(a + b) / 2 for a, b in zip(*last)]
    assert_losses_close(mean, expected_losses)


def test_pp_zb_hooks_zero_optimizer_stage2_refuses_a_tied_gradient_exchanged_after_its_reduce():
    """Tied across stages without no_sync: the exchange finds no .grad (zeros), writes one that stage 2
    would drop; step() raises on every rank, naming the fix, instead of each stage stepping its own half."""
    with pytest.raises(Exception, match="no_sync"):
        run_on_ranks(train_zb_dp, 4, "zero_optimizer_stage2", True, 2, 1)


def _engine_collectives(stage: int) -> list:
    """pp 2 x dp 2 through the engine, zb_h1 at m = 2 and m = 4: each step's (op, calls) over dp."""
    out = []
    for m in (2, 4):
        model, batches = _setup(1, 2 * m, tied=True)
        engine = ts.initialize(model, {
            "train_batch_size": 2 * m, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": m,
            "optimizer": {"type": "SGD", "params": SGD}, "zero_optimization": {"stage": stage},
            "parallel": {"pipeline": 2, "pipeline_schedule": "zb_h1"}})
        engine.comm_ledger.clear()
        engine.train_batch(next(iter(batches)))
        out.append({op: s["calls"] for op, s in engine.comm_ledger.by_op().items() if op not in ("isend", "irecv")})
    return out


@pytest.mark.parametrize("stage", [0, 2])
def test_pp_zb_hooks_engine_still_reduces_once_per_step_not_per_w(stage):
    """The engine's zb_h1 reduces after the schedule (DDP at ZeRO 0, reduce-scatters at 2): now that W
    runs the hooks, they must still only accumulate there (no_sync), so a step's collectives do not
    grow with the micro-batches: the same calls at m = 2 and m = 4, on every rank."""
    for rank, (two, four) in enumerate(run_on_ranks(_engine_collectives, 4, stage)):
        assert two == four, f"rank {rank}: collectives at m = 2 {two}, at m = 4 {four}"
        assert (two.get("all_reduce", 0) if stage == 0 else two.get("reduce_scatter", 0)) > 0
