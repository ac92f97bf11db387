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
    RECV_F, Action, add_communication, afab, interleaved_1f1b, one_f_one_b, zb_h1,
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
    """1F1B on 2 ranks, a different sequence length each step; the ledger of the first step."""
    from tinyscale.dist import comm

    rank = dist.get_rank()
    model, batches = _setup(3, False, 2 * m, len(lengths))
    plan = partition_gpt(model.config, 2)
    stages = {spec.stage: GPTStage(model, spec) for spec in stages_on_rank(plan, rank)}
    executor = PipelineExecutor(add_communication(one_f_one_b(2, m)), rank, stages, loss_fn=gpt_loss)
    optimizer = torch.optim.SGD([q for s in stages.values() for q in s.parameters()], lr=5e-2, momentum=0.9)
    losses, ledger_rows = [], None
    for T, (inputs, targets) in zip(lengths, batches):
        with comm.record() as ledger:
            loss = executor.run(inputs[:, :T].chunk(m), targets[:, :T].chunk(m))
        ledger_rows = ledger_rows or [(row.op, row.bytes) for row in ledger.rows]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(None if loss is None else loss.item())
    return losses, {k: q.detach().clone() for k, q in model.named_parameters()
                    if any(q is p for s in stages.values() for p in s.parameters())}, ledger_rows


def test_pp_executor_variable_sequence_lengths_and_message_count():
    """Steps of 8, 5 and 7 tokens: headers carry the shapes. Per step each rank sends m
    activations (rank 0) or input gradients (rank 1), each a 64-byte header (8 int64) and
    (rows, T, C) float64 of data: m x activation x 1 boundary x 2 directions in all."""
    lengths, m = [8, 5, 7], 2
    results = run_on_ranks(train_variable_lengths, 2, lengths, m)
    model, batches = _setup(3, False, 2 * m, len(lengths))
    batches = [(x[:, :T], y[:, :T]) for T, (x, y) in zip(lengths, batches)]
    config = {"train_batch_size": 2 * m, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": m,
              "optimizer": {"type": "SGD", "params": {"lr": 5e-2, "momentum": 0.9}}}
    expected_losses = ts.reference.train(model, batches, config)
    merged = {k: t for _, params, _ in results for k, t in params.items()}
    assert_state_dicts_close(merged, dict(model.named_parameters()), what="variable-length pipeline vs one process")
    assert_losses_close(results[1][0], expected_losses)
    activation = 2 * lengths[0] * model.config.d_model * 8  # rows x T x C x float64 bytes
    for _, _, rows in results:
        sends = [nbytes for op, nbytes in rows if op == "isend"]
        assert sorted(sends) == sorted([64] * m + [activation] * m)


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
