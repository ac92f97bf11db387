"""The executor on 2 ranks (float64): every schedule trains the GPT exactly like one process
(`tinyscale.reference.train`), tied embeddings and a layer count the stages do not divide
included. Run: `pytest tests/pipeline -k pp_executor`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig
from tinyscale.pipeline.executor import GPTStage, PipelineExecutor, exchange_tied_grads, gpt_loss
from tinyscale.pipeline.partition import partition_gpt, stages_on_rank
from tinyscale.pipeline.schedules import (
    F, RECV_B, RECV_F, SEND_B, SEND_F, Action, add_communication, afab, interleaved_1f1b, one_f_one_b, stage_ranks,
    zb_h1,
)
from tinyscale.pipeline.simulator import ScheduleError
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks

OPTIMIZERS = {  # SGD too: Adam hides a uniform gradient-scale bug
    "adamw": (torch.optim.AdamW, {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}}),
    "sgd": (torch.optim.SGD, {"type": "SGD", "params": {"lr": 5e-2, "momentum": 0.9, "weight_decay": 0.01}}),
}
SCHEDULES = {
    "afab": lambda p, m, v: afab(p, m),
    "1f1b": lambda p, m, v: one_f_one_b(p, m),
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": lambda p, m, v: zb_h1(p, m),
}


def _setup(n_layer, tied, rows, steps, seed=3):
    cfg = GPTConfig(vocab_size=64, max_seq_len=8, n_layer=n_layer, n_head=2, d_model=16, ffn_hidden=24,
                    tie_embeddings=tied)
    return (GPT(cfg, seed=seed, dtype=torch.float64),
            synthetic_token_batches(num_batches=steps, batch_size=rows, seq_len=8, vocab_size=64, seed=seed))


def train_pipeline(name, n_layer, tied, m, v, steps, optimizer):
    """On each rank: partition, run the schedule per global batch, step AdamW on its stages."""
    p, rank = dist.get_world_size(), dist.get_rank()
    model, batches = _setup(n_layer, tied, 2 * m, steps)
    plan = partition_gpt(model.config, p, virtual_stages=v)
    stages = {spec.stage: GPTStage(model, spec) for spec in stages_on_rank(plan, rank)}
    schedule = add_communication(SCHEDULES[name](p, m, v))
    executor = PipelineExecutor(schedule, rank, stages, loss_fn=gpt_loss)
    params = list({id(q): q for s in stages.values() for q in s.parameters()}.values())
    opt_class, spec = OPTIMIZERS[optimizer]
    optimizer = opt_class(params, **spec["params"])
    losses = []
    for inputs, targets in batches:
        loss = executor.run(inputs.chunk(m), targets.chunk(m))
        if tied and p > 1 and rank in (0, p - 1):
            exchange_tied_grads(model.embed.weight, p - 1 - rank)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(None if loss is None else loss.item())
    mine = {id(q) for q in params}
    return losses, {k: q.detach().clone() for k, q in model.named_parameters() if id(q) in mine}


def _reference(n_layer, tied, m, steps, optimizer):
    model, batches = _setup(n_layer, tied, 2 * m, steps)
    config = {"train_batch_size": 2 * m, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": m,
              "optimizer": OPTIMIZERS[optimizer][1]}
    losses = ts.reference.train(model, batches, config)
    return losses, {k: q.detach() for k, q in model.named_parameters()}


@pytest.mark.parametrize(("name", "n_layer", "tied", "m", "v", "optimizer"), [
    ("afab", 3, False, 3, 1, "adamw"), ("1f1b", 3, True, 4, 1, "sgd"), ("zb_h1", 3, True, 3, 1, "sgd"),
    ("interleaved_1f1b", 5, True, 4, 2, "adamw")])
def test_pp_executor_matches_single_process_float64(name, n_layer, tied, m, v, optimizer):
    """n_layer 3 on 2 stages (and 5 on 4 chunks): uneven; tied embedding and head on both ends."""
    _check_against_reference(2, name, n_layer, tied, m, v, optimizer)


@pytest.mark.parametrize(("name", "n_layer", "m", "v"), [("zb_h1", 6, 5, 1), ("interleaved_1f1b", 9, 4, 2)])
def test_pp_executor_four_ranks_match_single_process_float64(name, n_layer, m, v):
    """p = 4: 6 layers on 4 stages, 9 on 8 chunks (uneven), fewer micro-batches than 2p."""
    _check_against_reference(4, name, n_layer, True, m, v, "sgd")


def _check_against_reference(p, name, n_layer, tied, m, v, optimizer, steps=3):
    results = run_on_ranks(train_pipeline, p, name, n_layer, tied, m, v, steps, optimizer)
    expected_losses, expected = _reference(n_layer, tied, m, steps, optimizer)
    merged = {k: t for _, params in results for k, t in params.items()}
    assert merged.keys() == expected.keys()
    assert_state_dicts_close(merged, expected, what=f"{name} pipeline vs one process")
    assert all(losses == [None] * steps for losses, _ in results[:-1])  # only the last stage has the loss
    assert_losses_close(results[-1][0], expected_losses)


def test_pp_executor_refuses_a_broken_schedule():
    """Checked by the simulator before any message: no process group needed to see it."""
    model, _ = _setup(2, False, 2, 1)
    plan = partition_gpt(model.config, 2)
    schedule = add_communication(one_f_one_b(2, 2))
    schedule[1].remove(Action(1, RECV_F, 1))
    with pytest.raises(ScheduleError, match="1F1 runs before its input's receive 1RECV_F1"):
        PipelineExecutor(schedule, 1, {1: GPTStage(model, plan[1])}, loss_fn=gpt_loss)
    with pytest.raises(ValueError, match=r"rank 0 was given stages \[1\] but the schedule runs \[0\] there"):
        PipelineExecutor(add_communication(afab(2, 2)), 0, {1: GPTStage(model, plan[1])}, loss_fn=gpt_loss)


def train_variable_lengths(lengths, m):
    """1F1B on 2 ranks, the given sequence length each step; each step's bytes sent."""
    from tinyscale.dist import comm

    rank = dist.get_rank()
    model, batches = _setup(3, False, 2 * m, len(lengths))
    plan = partition_gpt(model.config, 2)
    stages = {spec.stage: GPTStage(model, spec) for spec in stages_on_rank(plan, rank)}
    executor = PipelineExecutor(add_communication(one_f_one_b(2, m)), rank, stages, loss_fn=gpt_loss)
    optimizer = torch.optim.SGD([q for s in stages.values() for q in s.parameters()], lr=5e-2, momentum=0.9)
    losses, sent = [], []
    for T, (inputs, targets) in zip(lengths, batches):
        with comm.record() as ledger:
            loss = executor.run(inputs[:, :T].chunk(m), targets[:, :T].chunk(m))
        sent.append(sorted(row.bytes for row in ledger.rows if row.op == "isend"))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(None if loss is None else loss.item())
    return losses, {k: q.detach().clone() for k, q in model.named_parameters()
                    if any(q is p for s in stages.values() for p in s.parameters())}, sent


def test_pp_executor_variable_sequence_lengths_and_message_count():
    """Steps of 8, 8 and 5 tokens. Per step each rank sends m activations (rank 0) or input
    gradients (rank 1), each a frame: (rows, T, C) float64 and one status element. A shape
    goes in a 64-byte header (8 int64) only when new (step 1); step 2 sends frames alone;
    step 3's shorter tensors go as a frame of the old size saying so, then header and frame."""
    lengths, m = [8, 8, 5], 2
    results = run_on_ranks(train_variable_lengths, 2, lengths, m)
    model, batches = _setup(3, False, 2 * m, len(lengths))
    batches = [(x[:, :T], y[:, :T]) for T, (x, y) in zip(lengths, batches)]
    config = {"train_batch_size": 2 * m, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": m,
              "optimizer": {"type": "SGD", "params": {"lr": 5e-2, "momentum": 0.9}}}
    expected_losses = ts.reference.train(model, batches, config)
    merged = {k: t for _, params, _ in results for k, t in params.items()}
    assert_state_dicts_close(merged, dict(model.named_parameters()), what="variable-length pipeline vs one process")
    assert_losses_close(results[1][0], expected_losses)
    frame = [2 * T * model.config.d_model * 8 + 8 for T in lengths]  # rows x T x C float64, + status
    for _, _, sent in results:
        assert sent[0] == sorted([64] * m + [frame[0]] * m)
        assert sent[1] == [frame[1]] * m
        assert sent[2] == sorted([frame[1]] * m + [64] * m + [frame[2]] * m)


@pytest.mark.parametrize(("name", "v"), [("afab", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 3)])
def test_pp_executor_one_rank_gradients_equal_plain_backward(name, v):
    """p = 1, no process group: with 3 chunks on one rank, activations and gradients pass
    between stages in memory; the B/W split sums to the full backward. float64, rtol 1e-10."""
    m = 3
    model, batches = _setup(3, True, 2 * m, 1)
    reference, _ = _setup(3, True, 2 * m, 1)
    inputs, targets = batches[0]
    plan = partition_gpt(model.config, 1, virtual_stages=v)
    executor = PipelineExecutor(add_communication(SCHEDULES[name](1, m, v)), 0,
                                {spec.stage: GPTStage(model, spec) for spec in plan}, loss_fn=gpt_loss)
    loss = executor.run(inputs.chunk(m), targets.chunk(m))
    expected = sum(reference(x, y) / m for x, y in zip(inputs.chunk(m), targets.chunk(m)))
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-10, atol=0)  # float64: summation order only
    grads = {k: q.grad for k, q in model.named_parameters()}
    assert_state_dicts_close(grads, {k: q.grad for k, q in reference.named_parameters()},
                             what=f"{name} gradients on one rank vs plain backward")


def _failing_runs(fail_at):
    """1F1B on 2 ranks, 3 runs; rank 1's loss raises in the runs listed. Per run on each rank:
    the error's type and its rank (StageFailed), or the loss."""
    from tinyscale.pipeline.executor import StageFailed

    rank = dist.get_rank()
    model, batches = _setup(3, False, 4, 3)
    stages = {spec.stage: GPTStage(model, spec) for spec in stages_on_rank(partition_gpt(model.config, 2), rank)}
    executor = PipelineExecutor(add_communication(one_f_one_b(2, 2)), rank, stages, loss_fn=gpt_loss)
    out = []
    for run, (inputs, targets) in enumerate(batches):
        if rank == 1:
            executor.loss_fn = (lambda *_: (_ for _ in ()).throw(MemoryError("boom"))) if run in fail_at else gpt_loss
        try:
            loss = executor.run(inputs.chunk(2), targets.chunk(2))
            out.append(None if loss is None else round(loss.item(), 6))
        except StageFailed as exc:
            out.append(("StageFailed", exc.rank))
        except MemoryError:
            out.append("MemoryError")
    return out


@pytest.mark.parametrize("fail_at", [(0,), (1,)], ids=["shapes-new", "shapes-known"])
def test_pp_executor_a_failed_stage_tells_its_peer_whether_shapes_are_new_or_known(fail_at):
    """A stage whose loss raises sends, instead of its gradients, messages naming it: a header
    alone when the shape is new (run 0), a frame with status 2 and then the header when both
    ends know the shape (run 1). The peer raises StageFailed(1) and the next run trains."""
    first, second = run_on_ranks(_failing_runs, 2, fail_at)
    for run in range(3):
        if run in fail_at:
            assert first[run] == ("StageFailed", 1) and second[run] == "MemoryError"
        else:
            assert first[run] is None and isinstance(second[run], float)



def _receive_windows(name, v):
    """Two steps of `name` on 2 ranks (m = 4), this rank: each irecv's (post, end of its wait),
    each isend's post, and the start of every compute action."""
    import time

    from tinyscale.dist import comm

    rank, m = dist.get_rank(), 4
    model, batches = _setup(4, False, 2 * m, 2)
    stages = {spec.stage: GPTStage(model, spec)
              for spec in stages_on_rank(partition_gpt(model.config, 2, virtual_stages=v), rank)}
    executor = PipelineExecutor(add_communication(SCHEDULES[name](2, m, v)), rank, stages, loss_fn=gpt_loss)
    starts = []
    for method in ("_forward", "_backward"):
        def timed(a, run=getattr(executor, method)):
            starts.append(time.perf_counter())
            run(a)
        setattr(executor, method, timed)
    with comm.record() as ledger:
        for inputs, targets in batches:
            executor.run(inputs.chunk(m), targets.chunk(m))
    return ([(r.start, r.end) for r in ledger.rows if r.op == "irecv"],
            [r.start for r in ledger.rows if r.op == "isend"], starts)


@pytest.mark.parametrize(("name", "v", "fewest", "most"), [("afab", 1, 3, 32), ("1f1b", 1, 0, 2),
                                                            ("interleaved_1f1b", 2, 0, 32)])
def test_pp_executor_posts_a_receive_early_only_when_no_send_to_its_peer_comes_first(name, v, fewest, most):
    """On gloo a receive may be in flight while the rank computes (posted as soon as the
    previous one from its peer arrived) only if the rank sends that peer nothing before it is
    taken; otherwise it is posted where the schedule takes it, as torch's pipelining does. A
    receive posted early while a send to the same peer follows was measured slower (1F1B), one
    with none in between faster (AFAB): lessons/08, issue 30. Receives in flight during compute,
    per rank: AFAB at least m - 1 (step 2, shapes known; step 1 learns them), 1F1B at most one
    a step (every receive but the last follows a send to the peer)."""
    for rank, (windows, sends, starts) in enumerate(run_on_ranks(_receive_windows, 2, name, v)):
        assert len(windows) >= 2 * 4 and len(starts) == 2 * 2 * 4 * v  # two steps, m = 4, F and B
        in_flight = [(s, e) for s, e in windows if any(s < t < e for t in starts)]
        crossed = [(s, e) for s, e in in_flight if any(s < t < e for t in sends)]
        assert not crossed, f"rank {rank}: {len(crossed)} receives were in flight while this rank sent to their peer"
        assert fewest <= len(in_flight) <= most, f"rank {rank}: {len(in_flight)} receives in flight during compute"


def test_pp_executor_posts_a_receive_early_only_where_its_send_comes_before_the_rank_reaches_it():
    """Of the receives with no send to their peer before them, the executor posts early (on
    gloo) only those whose send the simulator (unit costs) issues by the time the rank reaches
    them: where the rank waits for the send anyway, posting early saves no round trip. 1F1B's
    last receive on rank 0 (rank 1 still runs F and BW for it while rank 0 runs one BW) is
    posted where the schedule takes it; AFAB's streams of receives stay early (lessons/08)."""
    from torch import nn

    def early(schedule):
        where = stage_ranks(schedule)
        return [len(PipelineExecutor(schedule, r, {s: nn.Identity() for s, q in where.items() if q == r},
                                     loss_fn=gpt_loss).early) for r in range(len(schedule))]
    assert early(add_communication(one_f_one_b(2, 8))) == [0, 0]  # the rule alone: [1, 0]
    assert early(add_communication(one_f_one_b(4, 8))) == [0, 2, 1, 0]  # the rule alone: [3, 4, 2, 0]
    assert early(add_communication(afab(2, 8))) == [7, 7]
    assert early(add_communication(afab(4, 8))) == [7, 14, 14, 7]


def test_pp_executor_waits_sends_after_a_run_s_receives_only_where_that_cannot_deadlock():
    """On gloo a run of messages that receives then waits for the rank's sends, as torch's
    Schedule1F1B waits each fused send and receive (lessons/08, issue 30), but only where no
    rank can block so: a send completes once its peer has posted the receive. Interleaved 1F1B
    with m = 2p has two ranks each waiting for a send the other receives only later."""
    from tinyscale.pipeline.executor import _can_wait_sends
    for p, m in [(2, 8), (4, 8), (3, 5)]:
        assert _can_wait_sends(add_communication(afab(p, m)))
        assert _can_wait_sends(add_communication(one_f_one_b(p, m)))
        assert _can_wait_sends(add_communication(zb_h1(p, m)))
    assert not _can_wait_sends(add_communication(interleaved_1f1b(2, 8, 2)))
    # rank 0 waits for F0's send, which rank 1 receives only after F1, sent after that wait;
    # without the waits the same runs complete (each receive's send is posted)
    f0, f1 = Action(0, F, 0), Action(1, F, 0)
    rank0 = [Action(0, SEND_F, 0), Action(0, RECV_B, 0), f0, Action(0, SEND_F, 1)]
    rank1 = [Action(1, SEND_B, 0), Action(1, RECV_F, 1), f1, Action(1, RECV_F, 0)]
    assert not _can_wait_sends([rank0, rank1])
    assert _can_wait_sends([rank0, [Action(1, SEND_B, 0), Action(1, RECV_F, 0), f1, Action(1, RECV_F, 1)]])
