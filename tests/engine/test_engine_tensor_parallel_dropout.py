"""Tracker-mode dropout (`parallel.tensor_dropout: "tracker"`) through the engine.

- every rank seeded differently at dp 2 x tp 2: the TP peers still drop the replicated
  activations alike (the engine shares their stream), so the norm weights stay equal everywhere;
- the checkpoint's random state covers each rank's tracker stream: a resumed run is bit for bit
  the uninterrupted one (`pytest -k resume_exact`).
Run: `pytest tests/engine/test_engine_tensor_parallel_dropout.py`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.models import GPT
from tinyscale.testing import run_on_ranks
from tests.engine.test_engine_tensor_parallel import (
    ACCEPTANCE,
    DROPOUT_SEED,
    acceptance_batches,
    acceptance_config,
    batches,
    gpt_config,
    run_config,
)


def _tracker_body(steps: int):
    """dp 2 x tp 2, tracker-mode dropout, every rank seeded differently: the TP peers must still
    draw the replicated activations' masks alike (the engine shares their stream), or the copies
    of the norm weights drift apart."""
    model = GPT(ACCEPTANCE.with_(dropout=0.2), seed=5, dtype=torch.float64)
    torch.manual_seed(DROPOUT_SEED + 1000 * dist.get_rank())
    config = acceptance_config(2, 0, False)
    engine = ts.initialize(model, {**config, "parallel": {**config["parallel"], "tensor_dropout": "tracker"}})
    losses = [engine.train_batch(b) for b in acceptance_batches(steps)]
    norms = {n: p.detach().clone() for n, p in engine.model.named_parameters() if n.endswith("norm.weight")}
    return losses, norms


def test_engine_tensor_parallel_tracker_dropout_keeps_replicated_weights_equal():
    results = run_on_ranks(_tracker_body, 4, 2)
    losses, norms = results[0]
    for other_losses, other_norms in results[1:]:
        assert other_losses == losses  # the global-batch mean, the same on every rank
        assert all(torch.equal(other_norms[n], w) for n, w in norms.items()), "a TP peer's norm weights drifted"
    plain = ts.reference.train(GPT(ACCEPTANCE.with_(dropout=0.0), seed=5, dtype=torch.float64), acceptance_batches(2),
                               acceptance_config(1, 0, False))
    assert abs(losses[0] - plain[0]) > 1e-6  # the masks did drop something


def _resume_exact_body(path: str, steps: int):
    """Tracker-mode dropout at tp 2: an uninterrupted run, and a new engine (other weights, other
    generators) resumed from the checkpoint written midway; each rank its own tracker stream."""
    data = batches(2 * steps)
    config = {**run_config(2, 1, "adamw"), "parallel": {"tensor": 2, "tensor_dropout": "tracker"}}
    model = GPT(gpt_config(True).with_(dropout=0.2), seed=5, dtype=torch.float64)
    torch.manual_seed(21)
    engine = ts.initialize(model, config)
    straight = [engine.train_batch(b) for b in data[:steps]]
    engine.save_checkpoint(path)
    straight = [engine.train_batch(b) for b in data[steps:]]
    other = GPT(gpt_config(True).with_(dropout=0.2), seed=99, dtype=torch.float64)
    torch.manual_seed(1234)
    resumed = ts.initialize(other, config)
    resumed.load_checkpoint(path)
    return straight, [resumed.train_batch(b) for b in data[steps:]], engine.full_state_dict(), resumed.full_state_dict()


def test_engine_tensor_parallel_resume_exact_with_tracker_dropout(tmp_path):
    """The checkpoint's random state covers the tracker's streams: the resumed run is bit for bit the same."""
    for straight, resumed, state, resumed_state in run_on_ranks(_resume_exact_body, 2, str(tmp_path / "ckpt"), 2):
        assert resumed == straight
        assert all(torch.equal(resumed_state[k], v) for k, v in state.items())
