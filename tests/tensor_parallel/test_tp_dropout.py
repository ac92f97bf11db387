"""Dropout and replicated K/V heads under tensor parallelism.

- exact mode (dropout 0.1, tp 2, with and without SP): training equals `tinyscale.reference.train`
  with the same global seed (float64, rtol 1e-10);
- tracker mode: the masks of sharded activations differ across TP ranks, those of replicated
  ones agree, and the loss is the same on every rank;
- K/V heads replicated (tp 2 with n_kv_head 1, tp 4 with n_kv_head 2): training equals one
  process, and `full_state_dict_from_tp` gives back the unreplicated weights.
Run: `pytest tests/tensor_parallel -k "tensor_parallel and (dropout or kv_heads)"`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.dist import ParallelMesh
from tinyscale.models import GPT, GPTConfig
from tinyscale.tensor_parallel import apply_tensor_parallel, full_state_dict_from_tp
from tinyscale.tensor_parallel.random import TensorParallelDropout
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks
from tests.tensor_parallel.test_tp_gpt import VOCAB, _batches, _run_config

SEED = 11  # the global RNG seed: the shared dropout stream on every rank, and in the reference


def _config(tp: int, n_kv_head: int, dropout: float) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, max_seq_len=16, n_layer=2, n_head=4, n_kv_head=n_kv_head, d_model=16,
                     ffn_hidden=12 * tp, dropout=dropout, attn_impl="sdpa")


def train_body(n_kv_head: int, dropout: float, sequence_parallel: bool, steps: int):
    tp = dist.get_world_size()
    model = GPT(_config(tp, n_kv_head, dropout), seed=5, dtype=torch.float64)
    apply_tensor_parallel(model, ParallelMesh(tp=tp), sequence_parallel=sequence_parallel, exact_dropout=True)
    torch.manual_seed(SEED)
    losses = ts.reference.train(model, _batches(steps), _run_config("sgd"))
    return losses, full_state_dict_from_tp(model)


def _expected(tp: int, n_kv_head: int, dropout: float, steps: int):
    reference = GPT(_config(tp, n_kv_head, dropout), seed=5, dtype=torch.float64)
    torch.manual_seed(SEED)
    losses = ts.reference.train(reference, _batches(steps), _run_config("sgd"))
    return losses, reference.state_dict()


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no_sp", "sequence_parallel"])
def test_tensor_parallel_exact_dropout_trains_like_single_process(sequence_parallel):
    tp, steps = 2, 3
    expected_losses, expected = _expected(tp, 2, 0.1, steps)
    for losses, state in run_on_ranks(train_body, tp, 2, 0.1, sequence_parallel, steps):
        assert_losses_close(losses, expected_losses)
        assert_state_dicts_close(state, expected, what=f"exact dropout tp={tp} sp={sequence_parallel}")
    no_dropout, _ = _expected(tp, 2, 0.0, steps)
    assert abs(no_dropout[0] - expected_losses[0]) > 1e-6  # dropout did change the losses


@pytest.mark.parametrize(("tp", "n_kv_head"), [(2, 1), (4, 2)], ids=["tp2_kv1", "tp4_kv2"])
def test_tensor_parallel_replicated_kv_heads_train_like_single_process(tp, n_kv_head):
    steps = 3
    expected_losses, expected = _expected(tp, n_kv_head, 0.0, steps)
    for losses, state in run_on_ranks(train_body, tp, n_kv_head, 0.0, False, steps):
        assert_losses_close(losses, expected_losses)
        assert state["blocks.0.attn.wk.weight"].shape == expected["blocks.0.attn.wk.weight"].shape
        assert_state_dicts_close(state, expected, what=f"kv_heads={n_kv_head} replicated over tp={tp}")
    assert expected_losses[-1] < expected_losses[0]


def tracker_body(sequence_parallel: bool):
    tp = dist.get_world_size()
    model = GPT(_config(tp, 2, 0.5), seed=5, dtype=torch.float64)
    apply_tensor_parallel(model, ParallelMesh(tp=tp), sequence_parallel=sequence_parallel, dropout_seed=7)
    torch.manual_seed(SEED)  # the shared stream: seeded alike on every TP rank
    drops = [m for m in model.modules() if isinstance(m, TensorParallelDropout)]
    masks = {f"{m.dim}-{i}": m(torch.ones(2, 4, 6, 6, dtype=torch.float64)) for i, m in enumerate(drops)}
    gathered = [None] * tp
    dist.all_gather_object(gathered, masks)
    same = {key: all(torch.equal(g[key], gathered[0][key]) for g in gathered) for key in masks}
    idx, targets = next(iter(_batches(1)))
    loss = model(idx, targets)
    loss.backward()
    return same, loss.item()


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no_sp", "sequence_parallel"])
def test_tensor_parallel_dropout_tracker_differs_inside_the_region_and_agrees_outside(sequence_parallel):
    results = run_on_ranks(tracker_body, 2, sequence_parallel)
    same, _ = results[0]
    inside = {k: v for k, v in same.items() if k.startswith("1-")}
    outside = {k: v for k, v in same.items() if k.startswith("None-")}
    assert len(inside) == (4 if sequence_parallel else 2)  # attention probs (+ residuals under SP)
    assert not any(inside.values()), inside  # each rank its own stream
    assert len(outside) == (0 if sequence_parallel else 2)
    assert all(outside.values()), outside  # the shared stream
    assert len({loss for _, loss in results}) == 1  # replicated after g: the same loss on every rank
