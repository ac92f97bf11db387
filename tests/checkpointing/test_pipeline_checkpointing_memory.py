"""Activation checkpointing inside a pipeline, measured per stage (DT-8; lesson 05, "Inside a
pipeline stage, and with ZeRO-3"; `pytest -k pipeline_checkpointing_memory`).

A 4-layer GPT on pp 2 (1F1B, 4 micro-batches of 2 rows, T = 64, float32), policy "none" and
"full": the peak of the bytes a steady-state step creates and holds at once, on each stage
(the storages `tinyscale.memory.record_trace` sees: activations, gradients, temporaries),
and the losses. Full checkpointing lowers each stage's peak, stage 0 (which holds 2
micro-batches in flight, stage 1 one) the most, and changes no loss. `PEAKS` is lesson 05's
table, recomputed here; the step times beside it are one measurement, not tested.
"""

from __future__ import annotations

from pathlib import Path

import torch

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.memory import record_trace, replay
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
CFG = GPTConfig(vocab_size=64, max_seq_len=64, n_layer=4, n_head=4, d_model=64, ffn_hidden=128)


def _peaks():
    out = {}
    data = synthetic_token_batches(num_batches=2, batch_size=8, seq_len=64, vocab_size=64, seed=0)
    for policy in ("none", "full"):
        engine = ts.initialize(GPT(CFG, seed=0, dtype=torch.float32), {
            "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "activation_checkpointing": {"policy": policy},
            "parallel": {"pipeline": 2, "pipeline_schedule": "1f1b"}})
        losses = [engine.train_batch(data[0])]  # AdamW's states exist from here: a steady-state step next
        events = record_trace(lambda: losses.append(engine.train_batch(data[1])))
        out[policy] = (replay(events, capacity=1 << 40)["peak_requested"], losses)
    return out


def test_pipeline_checkpointing_memory_lowers_every_stage_s_peak_and_changes_no_loss():
    stages = run_on_ranks(_peaks, 2)
    text = (ROOT / "lessons/05-activation-checkpointing.md").read_text()
    for stage, out in enumerate(stages):
        (none, losses_none), (full, losses_full) = out["none"], out["full"]
        assert full < none and losses_full == losses_none  # the recomputation is the same float32 forward
        row = f"| {stage} | {none:,} | {full:,} | {full / none:.2f} |"
        assert row in text, f"lesson 05 lacks the row\n{row}"
    assert stages[0]["none"][0] - stages[0]["full"][0] > stages[1]["none"][0] - stages[1]["full"][0]
