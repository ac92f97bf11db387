"""DT-7: variable-length sequences in a pipeline, padded per micro-batch or bucketed by length
(tinyscale.pipeline.varlen). Shapes sent before activations when they change: test_executor's
test_pp_executor_variable_sequence_lengths_and_message_count. Timings: lesson 08, reported.

    pytest -k varlen_dt7
"""

from __future__ import annotations

import torch

from tinyscale.models import GPT, GPTConfig
from tinyscale.pipeline.executor import gpt_loss
from tinyscale.pipeline.partition import partition_gpt
from tinyscale.pipeline.varlen import (
    IGNORE, bucket_micro_batches, collate, pad_micro_batches, padded_fraction, stage_times,
)

LENGTHS = [3, 9, 2, 8, 4, 10, 3, 9]  # long and short alternate: padding's worst case


def test_varlen_dt7_bucketing_cuts_the_padded_fraction_exactly():
    pad, bucket = pad_micro_batches(LENGTHS, 2), bucket_micro_batches(LENGTHS, 2)
    assert pad == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [[LENGTHS[i] for i in g] for g in bucket] == [[2, 3], [3, 4], [8, 9], [9, 10]]
    assert sorted(i for g in bucket for i in g) == list(range(len(LENGTHS)))  # every sequence once
    # padding computes 2 x (9 + 8 + 10 + 9) = 72 tokens for 48 real; bucketing 2 x (3 + 4 + 9 + 10) = 52
    assert padded_fraction(LENGTHS, pad) == 1 - 48 / 72
    assert padded_fraction(LENGTHS, bucket) == 1 - 48 / 52


def test_varlen_dt7_padding_leaves_each_sequences_logits_and_loss_unchanged():
    cfg = GPTConfig(vocab_size=32, max_seq_len=16, n_layer=2, n_head=2, d_model=16, ffn_hidden=24)
    model = GPT(cfg, seed=0, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 32, (n,), generator=g) for n in LENGTHS]
    alone = [model(s[None, :-1])[0] for s in seqs]
    for group in bucket_micro_batches(LENGTHS, 2) + pad_micro_batches(LENGTHS, 2):
        inputs, targets = collate(seqs, group)
        logits = model(inputs)
        for row, i in enumerate(group):
            n = len(seqs[i]) - 1
            # float64, causal: the real positions never attend to the padding; only summation
            # order could differ (~1e-16 relative), a leak through the mask is O(1e-2)
            torch.testing.assert_close(logits[row, :n], alone[i], rtol=1e-12, atol=1e-12)
            assert (targets[row, n:] == IGNORE).all()
        real = sum(len(seqs[i]) - 1 for i in group)
        per_token = sum(gpt_loss(alone[i][None], seqs[i][None, 1:]) * (len(seqs[i]) - 1) for i in group)
        torch.testing.assert_close(gpt_loss(logits, targets), per_token / real, rtol=1e-12, atol=0)


def test_varlen_dt7_stage_times_cover_every_stage_and_micro_batch():
    cfg = GPTConfig(vocab_size=32, max_seq_len=16, n_layer=2, n_head=2, d_model=16, ffn_hidden=24)
    model = GPT(cfg, seed=0, dtype=torch.float64)
    seqs = [torch.randint(0, 32, (n,)) for n in LENGTHS]
    times = stage_times(model, partition_gpt(cfg, 2), seqs, pad_micro_batches(LENGTHS, 2), repeats=1)
    assert len(times) == 4 and all(len(t) == 2 and all(s > 0 for s in t) for t in times)
    assert all(p.grad is None for p in model.parameters())  # zeroed after each micro-batch
