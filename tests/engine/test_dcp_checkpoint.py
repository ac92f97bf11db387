"""Sharded checkpoints on torch.distributed.checkpoint (`engine/dcp_checkpoint.py`).

    pytest -k dcp_checkpoint    round trips in several layouts; each rank's file holds its pieces only
    pytest -k dcp_reshard       saved under 3 layouts, loaded under 3 others: the continuation is exact

The model is the odd GPT of the layout matrix (vocab 61: TP vocab shards padded; 6 query on 2 K/V
heads: at tp 2 each rank copies one; tied embedding and head: on two pipeline stages; 3 layers),
float64, AdamW with weight decay and clipping that binds. The global batch is 4 rows in every
layout, so every layout takes the same steps; they agree at rtol 1e-10 (a float64 reduction in
another order differs by ~1e-15 per op; 1e-10 leaves 5 orders of margin and still fails on any
real error, such as one element of one moment off).
"""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.engine import checkpoint_io, dcp_checkpoint
from tinyscale.engine.plan import placements
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks

VOCAB, SEQ, ROWS = 61, 10, 4
RTOL = 1e-10  # see the module docstring


def gpt(seed: int = 7, vocab: int = VOCAB) -> GPT:
    cfg = GPTConfig(vocab_size=vocab, max_seq_len=SEQ, n_layer=3, n_head=6, n_kv_head=2, d_model=12,
                    ffn_hidden=20, tie_embeddings=True)
    return GPT(cfg, seed=seed, dtype=torch.float64)


def config(dp: int = 1, pp: int = 1, tp: int = 1, stage: int = 0, sp: bool = False, **extra) -> dict:
    parallel = {"tensor": tp, "pipeline": pp}
    if sp:
        parallel["sequence_parallel"] = True
    return {"train_batch_size": ROWS, "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": ROWS // dp, "gradient_clipping": 0.3,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage}, "parallel": parallel, **extra}


BATCHES = synthetic_token_batches(num_batches=6, batch_size=ROWS, seq_len=SEQ, vocab_size=VOCAB, seed=9)


def _uninterrupted(steps: int) -> tuple[list[float], dict]:
    engine = ts.initialize(gpt(), config())
    return [engine.train_batch(b) for b in BATCHES[:steps]], engine.full_state_dict()


# --- dcp_checkpoint: round trips, and what each rank writes ------------------------------------

ROUND_TRIPS = {  # name: (world, layout)
    "zero1-dp4": (4, {"dp": 4, "stage": 1}),
    "zero3-dp2-tp2-sp": (4, {"dp": 2, "tp": 2, "stage": 3, "sp": True}),
    "zero2-dp2-pp2-tied": (4, {"dp": 2, "pp": 2, "stage": 2}),
    "zero0-pp2-tp2-tied": (4, {"pp": 2, "tp": 2}),
}


def _written_elements(version: Path) -> dict[int, int]:
    """Model elements in each rank's file, read from DCP's metadata (the file that holds each chunk)."""
    md = dcp_checkpoint.read_metadata(version)
    out: dict[int, int] = {}
    for index, info in md.storage_data.items():
        if index.fqn.startswith(dcp_checkpoint.MODEL):
            entry = md.state_dict_metadata[index.fqn]
            chunk = next(c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset))
            rank = int(info.relative_path.split("_")[2])
            out[rank] = out.get(rank, 0) + math.prod(chunk.sizes)
    return out


def _round_trips(path: str) -> list:
    out = []
    for name, (world, layout) in ROUND_TRIPS.items():
        engine = ts.initialize(gpt(), config(**layout))
        losses = [engine.train_batch(b) for b in BATCHES[:2]]
        where = f"{path}/{name}"
        engine.save_checkpoint(where)
        counted = sum(pl.counted_elements for pl in placements(engine).values())
        if engine.zero is None and engine.reduce_rank != 0:
            counted = 0  # a replica over dp writes nothing
        after = engine.train_batch(BATCHES[2])
        fresh = ts.initialize(gpt(seed=1), config(**layout))
        fresh.load_checkpoint(where)
        resumed = fresh.train_batch(BATCHES[2])
        out.append((name, losses + [after], resumed, engine.full_state_dict(), fresh.full_state_dict(), counted))
    return out


def test_dcp_checkpoint_round_trips_and_each_rank_writes_only_its_pieces(tmp_path):
    """In each layout a fresh engine (other weights) loads what one saved and takes the same next
    step; the file of rank r holds exactly the model elements rank r counts (DCP's metadata), and
    the chunks of every tensor tile it (DCP's global plan validation): no padding, no copy twice."""
    per_rank = run_on_ranks(_round_trips, 4, str(tmp_path))
    expected_losses, _ = _uninterrupted(3)
    numel = sum(p.numel() for p in gpt().parameters())  # the tied table once
    for i, name in enumerate(ROUND_TRIPS):
        version = checkpoint_io.live_version(tmp_path / name)
        written = _written_elements(version)
        assert sum(written.values()) == numel, name
        for rank, results in enumerate(per_rank):
            _, losses, resumed, state, fresh_state, counted = results[i]
            assert written.get(rank, 0) == counted, (name, rank, written)
            assert_losses_close(losses, expected_losses, rtol=RTOL)
            assert resumed == losses[-1], name  # the same layout: bit for bit
            assert_state_dicts_close(fresh_state, state, rtol=0, atol=0)


def test_dcp_checkpoint_boxes_cover_a_flat_range_exactly():
    """`boxes` cuts a flat range into at most 2 ndim - 1 boxes whose elements are the range, in order."""
    for shape in [(7,), (5, 3), (4, 3, 2), (1, 6)]:
        n = math.prod(shape)
        for start in range(n):
            for end in range(start, n + 1):
                got = dcp_checkpoint.boxes(shape, start, end)
                assert len(got) <= 2 * len(shape) - 1
                marks = torch.zeros(shape, dtype=torch.long)
                for offsets, sizes in got:
                    marks[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
                flat = marks.view(-1)
                assert flat[start:end].eq(1).all() and flat[:start].eq(0).all() and flat[end:].eq(0).all()


# --- dcp_reshard: any layout loads any other ---------------------------------------------------

CHAIN = [  # (world, layout, steps before its save): 4 -> 2 -> 1 -> 4, tp, pp and ZeRO changing
    (4, {"dp": 2, "tp": 2, "stage": 1, "sp": True}, 2),
    (2, {"pp": 2, "stage": 0}, 1),
    (1, {"stage": 3}, 1),
    (4, {"dp": 2, "pp": 2, "stage": 3}, 1),
]


def _segment(path: str, index: int) -> tuple[list[float], dict]:
    _, layout, steps = CHAIN[index]
    engine = ts.initialize(gpt(seed=7 if index == 0 else index), config(**layout))  # later: other weights
    if index:
        engine.load_checkpoint(f"{path}/{index - 1}")
    start = engine.step
    losses = [engine.train_batch(b) for b in BATCHES[start:start + steps]]
    if index < len(CHAIN) - 1:
        engine.save_checkpoint(f"{path}/{index}")
    return losses, engine.full_state_dict()


def test_dcp_reshard_save_and_load_across_layouts_continues_exactly(tmp_path):
    """dp 2 x tp 2 (ZeRO 1, SP) -> pp 2 (tied table on two stages) -> one process (ZeRO 3) ->
    dp 2 x pp 2 (ZeRO 3): each segment loads the previous one's checkpoint into other weights,
    and the losses and final parameters equal the uninterrupted run's."""
    losses = []
    for i, (world, _, _) in enumerate(CHAIN):
        got = run_on_ranks(_segment, world, str(tmp_path), i) if world > 1 else [_segment(str(tmp_path), i)]
        losses += got[0][0]
        final = got[0][1]
    expected, state = _uninterrupted(len(losses))
    assert_losses_close(losses, expected, rtol=RTOL)
    assert_state_dicts_close(final, state, rtol=RTOL)


# --- dcp_checkpoint_memory: a rank never holds the whole model while saving --------------------

class _PeakRSS:
    """Peak resident set size above the level at entry, sampled every millisecond (/proc/self/statm)."""

    def __enter__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        self.growth = self.peak - self.base


def _save_memory(path: str) -> tuple[int, int, int]:
    cfg = GPTConfig(vocab_size=1024, max_seq_len=SEQ, n_layer=4, n_head=8, d_model=256, ffn_hidden=704)
    engine = ts.initialize(GPT(cfg, seed=0, dtype=torch.float64), config(dp=dist.get_world_size(), stage=3))
    tokens = synthetic_token_batches(num_batches=1, batch_size=ROWS, seq_len=SEQ, vocab_size=1024, seed=1)[0]
    engine.train_batch(tokens)
    model_bytes = sum(p.numel() for p in GPT(cfg, seed=0).parameters()) * 8
    with _PeakRSS() as saving:
        engine.save_checkpoint(path)
    with _PeakRSS() as gathering:  # the control: a whole model does show up in this measurement
        state = engine.full_state_dict()
    del state
    return model_bytes, saving.growth, gathering.growth


def test_dcp_checkpoint_memory_a_save_holds_no_rank_near_the_whole_model(tmp_path):
    """ZeRO-3 over 2 ranks, a 3.7M-parameter GPT in float64 (29 MB; with AdamW's moments 88 MB):
    while saving, no rank's resident memory grows by a quarter of the model's parameter bytes
    (the old path gathered parameters and moments whole on every rank: 88 MB). The control,
    `full_state_dict()`, grows by at least 90% of them, so the measurement does see a whole model."""
    for model_bytes, saving, gathering in run_on_ranks(_save_memory, 2, str(tmp_path / "ckpt")):
        assert saving < model_bytes / 4, (saving, model_bytes)
        assert gathering > 0.9 * model_bytes, (gathering, model_bytes)
