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
import re
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tests.engine.test_layout_matrix import nonzero_biases
from tinyscale.data import synthetic_token_batches
from tinyscale.engine import checkpoint, checkpoint_io, dcp_checkpoint
from tinyscale.engine.plan import placements
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks

VOCAB, SEQ, ROWS = 61, 10, 4
RTOL = 1e-10  # see the module docstring
DROPOUT = 0.1


def gpt(seed: int = 7, vocab: int = VOCAB, dropout: float = 0.0, n_layer: int = 3, bias: bool = False) -> GPT:
    cfg = GPTConfig(vocab_size=vocab, max_seq_len=SEQ, n_layer=n_layer, n_head=6, n_kv_head=2, d_model=12,
                    ffn_hidden=20, tie_embeddings=True, dropout=dropout, dropout_masks="counter", bias=bias)
    return nonzero_biases(GPT(cfg, seed=seed, dtype=torch.float64), seed)


def config(dp: int = 1, pp: int = 1, tp: int = 1, stage: int = 0, sp: bool = False, cp: int = 1,
           virtual: int = 1, **extra) -> dict:
    parallel = {"tensor": tp, "pipeline": pp}
    if sp:
        parallel["sequence_parallel"] = True
    if cp > 1:
        parallel["context"] = cp
    if virtual > 1:
        parallel |= {"virtual_stages": virtual, "pipeline_schedule": "interleaved_1f1b"}
    return {"train_batch_size": ROWS, "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": ROWS // dp, "gradient_clipping": 0.3,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage}, "parallel": parallel, **extra}


BATCHES = synthetic_token_batches(num_batches=6, batch_size=ROWS, seq_len=SEQ, vocab_size=VOCAB, seed=9)


def _uninterrupted(steps: int, dropout: float = 0.0, n_layer: int = 3, bias: bool = False) -> tuple[list[float], dict]:
    engine = ts.initialize(gpt(dropout=dropout, n_layer=n_layer, bias=bias), config())
    return [engine.train_batch(b) for b in BATCHES[:steps]], engine.full_state_dict()


# --- dcp_checkpoint: round trips, and what each rank writes ------------------------------------

ROUND_TRIPS = {  # name: layout, on 4 ranks; the first two by default, all with --thorough
    "zero3-dp2-tp2-sp": {"dp": 2, "tp": 2, "stage": 3, "sp": True},
    "zero2-dp2-pp2-tied": {"dp": 2, "pp": 2, "stage": 2},
    "zero1-dp4": {"dp": 4, "stage": 1},
    "zero0-pp2-tp2-tied": {"pp": 2, "tp": 2},
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


def _round_trips(path: str, names: list[str]) -> list:
    out = []
    for name in names:
        layout = ROUND_TRIPS[name]
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


@pytest.mark.parametrize("names", [pytest.param(list(ROUND_TRIPS)[:2], id="default"),
                                   pytest.param(list(ROUND_TRIPS)[2:], id="more", marks=pytest.mark.thorough)])
def test_dcp_checkpoint_round_trips_and_each_rank_writes_only_its_pieces(tmp_path, names):
    """In each layout a fresh engine (other weights) loads what one saved and takes the same next
    step; the file of rank r holds exactly the model elements rank r counts (DCP's metadata), and
    the chunks of every tensor tile it (DCP's global plan validation): no padding, no copy twice."""
    per_rank = run_on_ranks(_round_trips, 4, str(tmp_path), names)
    expected_losses, _ = _uninterrupted(3)
    numel = sum(p.numel() for p in gpt().parameters())  # the tied table once
    for i, name in enumerate(names):
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


CHAIN_CP_VIRTUAL = [  # 4 -> 2 -> 4: context parallelism and virtual stages changing
    (4, {"dp": 2, "cp": 2, "stage": 2}, 2),
    (2, {"pp": 2, "virtual": 2, "stage": 1}, 1),
    (4, {"cp": 2, "tp": 2, "stage": 3}, 1),
]
CHAINS = {"tp-pp-world": CHAIN, "cp-virtual": CHAIN_CP_VIRTUAL}
LAYERS = {"tp-pp-world": 3, "cp-virtual": 4}  # 2 ranks x 2 virtual stages need 4 blocks


def _segment(path: str, index: int, chain: str = "tp-pp-world") -> tuple[list[float], dict]:
    links = CHAINS[chain]
    _, layout, steps = links[index]
    # later segments: other weights; counter dropout masks, a function of (seed, step, layer, position)
    engine = ts.initialize(gpt(seed=7 if index == 0 else index, dropout=DROPOUT, n_layer=LAYERS[chain], bias=True),
                           config(**layout))
    if index:
        engine.load_checkpoint(f"{path}/{index - 1}")
    start = engine.step
    losses = [engine.train_batch(b) for b in BATCHES[start:start + steps]]
    if index < len(links) - 1:
        engine.save_checkpoint(f"{path}/{index}")
    return losses, engine.full_state_dict()


@pytest.mark.parametrize("chain", list(CHAINS))
def test_dcp_reshard_save_and_load_across_layouts_continues_exactly(tmp_path, chain):
    """tp-pp-world: dp 2 x tp 2 (ZeRO 1, SP) -> pp 2 (tied table on two stages) -> one process
    (ZeRO 3) -> dp 2 x pp 2 (ZeRO 3); cp-virtual: dp 2 x cp 2 (ZeRO 2) -> pp 2 with 2 virtual
    stages each (interleaved 1F1B, ZeRO 1) -> cp 2 x tp 2 (ZeRO 3). Each segment loads the
    previous one's checkpoint into other weights, and the losses and final parameters equal the
    uninterrupted run's, dropout included: counter masks (GPTConfig.dropout_masks="counter")
    need only the step, which the checkpoint holds. Stream masks (torch's generator) resume
    exactly only on the same world size, and
    `checkpoint.restore_rng` warns otherwise (`pytest -k resume_exact` tests that). The GPT has
    linear biases: a row-parallel bias is saved once, and every stage's biases travel."""
    losses = []
    for i, (world, _, _) in enumerate(CHAINS[chain]):
        got = (run_on_ranks(_segment, world, str(tmp_path), i, chain) if world > 1
               else [_segment(str(tmp_path), i, chain)])
        losses += got[0][0]
        final = got[0][1]
    expected, state = _uninterrupted(len(losses), DROPOUT, LAYERS[chain], bias=True)
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
    # A process's first save allocates about 7 MB that it keeps, whatever the model's size (measured
    # 2026-11-27 in fresh rank processes: 7.0 MB for 1 layer, then 0.6-0.9 MB for 4 and 2-3 MB for 12
    # saved after it): a tiny model's save pays it first, so that the measurement below sees what
    # this model's save holds, with or without earlier tests in the same processes.
    ts.initialize(gpt(), config(dp=dist.get_world_size(), stage=3)).save_checkpoint(path + "-first")
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
    `full_state_dict()`, grows by at least 90% of them after the save, so the measurement does see a
    whole model in processes that have saved."""
    for model_bytes, saving, gathering in run_on_ranks(_save_memory, 2, str(tmp_path / "ckpt")):
        assert saving < model_bytes / 4, (saving, model_bytes)
        assert gathering > 0.9 * model_bytes, (gathering, model_bytes)


# --- dcp_faults: a damaged shard or a failed write is refused on every rank, none hangs ---------

def _save_dp2(path: str) -> None:
    engine = ts.initialize(gpt(), config(dp=2, stage=3))
    engine.train_batch(BATCHES[0])
    engine.save_checkpoint(path)


def _load_dp2(path: str) -> str | None:
    engine = ts.initialize(gpt(seed=1), config(dp=2, stage=3))
    try:
        engine.load_checkpoint(path)
    except checkpoint_io.CheckpointError as exc:
        return str(exc)
    return None


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


DAMAGES = {"missing": lambda f: f.unlink(), "truncated": _truncate, "corrupt": _flip}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_dcp_faults_a_damaged_shard_is_refused_on_every_rank_naming_file_and_rank(tmp_path, damage):
    """Rank 1's shard file missing, cut in half or with one byte flipped: both ranks raise
    CheckpointError naming the file and the rank that found it (the checksums are verified
    before any read, a share of the files per rank), and neither waits for the other."""
    path = tmp_path / "ckpt"
    run_on_ranks(_save_dp2, 2, str(path), timeout_s=120)
    DAMAGES[damage](checkpoint_io.live_version(path) / "__1_0.distcp")
    errors = run_on_ranks(_load_dp2, 2, str(path), timeout_s=120)
    word = "missing" if damage == "missing" else "corrupt"
    finders = set()
    for rank, error in enumerate(errors):
        assert error is not None and "__1_0.distcp" in error and f"is {word}" in error, (rank, error)
        finders.add(re.search(r"found by rank (\d)", error).group(1))
    assert len(finders) == 1, errors  # every rank names the same rank: the one that verified the file


def _save_failing_on_rank1(path: str) -> str:
    engine = ts.initialize(gpt(), config(dp=2, stage=1))
    engine.train_batch(BATCHES[0])
    engine.save_checkpoint(path)
    engine.train_batch(BATCHES[1])
    real = torch.save
    if dist.get_rank() == 1:
        def failing(obj, f, *args, **kwargs):
            raise OSError("disk full (simulated on rank 1)")
        torch.save = failing
    try:
        engine.save_checkpoint(path)
    except BaseException as exc:  # noqa: BLE001 - what each rank sees is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        torch.save = real
    return "saved"


def test_dcp_faults_a_write_failing_on_one_rank_leaves_the_previous_checkpoint_live(tmp_path):
    """Rank 1 cannot write: rank 1 raises its own error, rank 0 a CheckpointError naming rank 1
    and it; `latest` still names the first version, which loads."""
    path = tmp_path / "ckpt"
    errors = run_on_ranks(_save_failing_on_rank1, 2, str(path), timeout_s=120)
    assert errors[1].startswith("OSError: disk full (simulated on rank 1)"), errors[1]
    assert errors[0].startswith("CheckpointError") and "rank 1" in errors[0] and "disk full" in errors[0], errors[0]
    assert checkpoint_io.live_version(path).name == "v000001"
    assert checkpoint.read(path)[2]["step"] == 1


# --- dcp_async_save: written in the background, committed only when every rank's write succeeded

def _async(path: str, fail_rank: int | None) -> tuple:
    engine = ts.initialize(gpt(), config(dp=2, stage=1))
    engine.train_batch(BATCHES[0])
    start = time.perf_counter()
    engine.save_checkpoint(f"{path}/sync")
    blocking = time.perf_counter() - start
    snapshot = engine.full_state_dict()
    real = torch.save
    gate, released = threading.Event(), []
    if dist.get_rank() == fail_rank:  # only the writer thread calls torch.save while training runs
        def failing(obj, f, *args, **kwargs):
            raise OSError(f"disk full (simulated on rank {fail_rank})")
        torch.save = failing
    elif fail_rank is None:  # the write cannot start until training has gone on: a save that
        def gated(obj, f, *args, **kwargs):  # blocked the caller would time out here instead
            released.append(gate.wait(timeout=60))
            return real(obj, f, *args, **kwargs)
        torch.save = gated
    try:
        start = time.perf_counter()
        engine.save_checkpoint(f"{path}/async", blocking=False)
        stall = time.perf_counter() - start
        for b in BATCHES[1:3]:  # training changes what is being written
            engine.train_batch(b)
        gate.set()
        try:
            engine.wait_checkpoint()
            error = None
        except BaseException as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"
    finally:
        torch.save = real
    committed = Path(f"{path}/async/latest").exists()
    if fail_rank is not None:
        engine.save_checkpoint(f"{path}/async")  # the next save commits
    fresh = ts.initialize(gpt(seed=1), config(dp=2, stage=1))
    fresh.load_checkpoint(f"{path}/async")
    return blocking, stall, error, committed, snapshot, fresh.step, fresh.full_state_dict(), engine.full_state_dict(), \
        released


def test_dcp_async_save_writes_the_snapshot_while_training_goes_on(tmp_path):
    """The async save returns before anything is written and holds the state of the moment it
    was called although two steps run before its writes may start (each write waits for a gate
    that opens after them; a save that blocked its caller would wait out the gate's 60 s
    instead). The stall, printed beside a blocking save's time, is the snapshot's copy to host
    memory and the version's start (not asserted: two wall-clock times on shared cores)."""
    for blocking, stall, error, committed, snapshot, step, loaded, _, released in \
            run_on_ranks(_async, 2, str(tmp_path), None):
        assert error is None and committed and step == 1
        assert released and all(released), released  # every write was released by the open gate
        assert_state_dicts_close(loaded, snapshot, rtol=0, atol=0)
    print(f"blocking save {blocking * 1e3:.1f} ms, async stall {stall * 1e3:.1f} ms")


def test_dcp_async_save_failing_on_one_rank_does_not_move_latest(tmp_path):
    """Rank 1's background write fails: the future raises on both ranks and `latest` does not move
    (the directory holds no live version until the next save, which then commits normally)."""
    results = run_on_ranks(_async, 2, str(tmp_path), 1)
    assert "disk full" in results[1][2] and "rank 1" in results[0][2], [r[2] for r in results]
    for _, _, _, committed, _, step, loaded, final, _ in results:
        assert not committed
        assert step == 3  # the next, synchronous save's state
        assert_state_dicts_close(loaded, final, rtol=0, atol=0)


WIDE = [  # --thorough: every axis at once on 8 ranks, then 2 ranks of another layout
    (8, {"dp": 2, "pp": 2, "tp": 2, "stage": 1, "sp": True}, 2),
    (2, {"tp": 2, "stage": 2}, 2),
]


def _wide_segment(path: str, index: int) -> tuple[list[float], dict]:
    _, layout, steps = WIDE[index]
    engine = ts.initialize(gpt(seed=7 if index == 0 else 5, dropout=DROPOUT, bias=True), config(**layout))
    if index:
        engine.load_checkpoint(f"{path}/0")
    losses = [engine.train_batch(b) for b in BATCHES[engine.step:engine.step + steps]]
    if index == 0:
        engine.save_checkpoint(f"{path}/0")
    return losses, engine.full_state_dict()


@pytest.mark.thorough
def test_dcp_reshard_eight_ranks_dp_pp_tp_to_two_ranks_thorough(tmp_path):
    """dp 2 x pp 2 x tp 2 (ZeRO 1, SP, the tied table on two stages of two TP shards each) saves;
    tp 2 at ZeRO 2 on 2 ranks continues exactly like the uninterrupted run."""
    losses = []
    for i, (world, _, _) in enumerate(WIDE):
        got = run_on_ranks(_wide_segment, world, str(tmp_path), i)
        losses += got[0][0]
    expected, state = _uninterrupted(len(losses), DROPOUT, bias=True)  # 3 layers, as _wide_segment's
    assert_losses_close(losses, expected, rtol=RTOL)
    assert_state_dicts_close(got[0][1], state, rtol=RTOL)
