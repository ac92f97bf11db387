"""A bounded `comm.Ledger` (``max_rows``) keeps the last rows and counts every call.

The engine's ledger is bounded (`engine.COMM_LEDGER_MAX_ROWS`) so that a long run does not keep a
row for every call: its `rows` hold the window, while `bytes`, `bus_bytes`, `calls`, `seconds` and
`by_op` equal an unbounded ledger's over the same calls. Run: `pytest -k comm_ledger`.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.dist import comm
from tinyscale.engine import engine as engine_module
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import run_on_ranks

WINDOW = 7
SELECTIONS = [None, "all_reduce", "all_gather", "reduce_scatter", "broadcast", "isend", "irecv",
              ("all_gather", "reduce_scatter")]
# `seconds` of several ops (or of all) is summed in another grouping by a bounded ledger (retired
# per-op totals, then the window) than by an unbounded one (every row in order): a few hundred
# positive terms, so each sum is within (n - 1) eps < 400 * 2.2e-16 < 1e-13 of the exact one, relative.
SECONDS_RTOL = 1e-12


def _totals(ledger: comm.Ledger) -> dict:
    """Every total a ledger reports, per selection (seconds apart: compared within SECONDS_RTOL)."""
    return {"exact": [(ledger.bytes(s), ledger.bus_bytes(s), ledger.calls(s)) for s in SELECTIONS] + [ledger.by_op()],
            "seconds": [ledger.seconds(s) for s in SELECTIONS]}


def _assert_same_totals(bounded: dict, unbounded: dict) -> None:
    # exact: bytes and calls are ints; bus_bytes on 2 ranks are multiples of half a byte (ring
    # factors 1, 1/2, 0), exact in any order; by_op adds each op's figures in row order either way
    assert bounded["exact"] == unbounded["exact"]
    for got, want in zip(bounded["seconds"], unbounded["seconds"]):
        assert math.isclose(got, want, rel_tol=SECONDS_RTOL, abs_tol=0.0)


def _collectives(calls: int) -> None:
    """About `calls` real ops of every kind, of varying sizes, on the world group."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for i in range(calls // 6):
        numel = 1 + i % 5
        x = torch.full((numel,), float(rank + i))
        comm.all_reduce(x)
        comm.broadcast(x, src=i % n)
        comm.all_gather(torch.empty(n * numel), x)
        comm.reduce_scatter(torch.empty(numel), torch.ones(n * numel))
        recv = torch.empty(numel)
        for work in comm.batch_isend_irecv([comm.P2POp("isend", x, (rank + 1) % n),
                                            comm.P2POp("irecv", recv, (rank - 1) % n)]):
            work.wait()


def _bounded_beside_unbounded():
    with comm.record() as every, comm.record(comm.Ledger(max_rows=WINDOW)) as bounded:
        _collectives(300)
    window_is_last = len(bounded.rows) == WINDOW and all(a is b for a, b in zip(bounded.rows, every.rows[-WINDOW:]))
    result = {"calls": every.calls(), "window_is_last": window_is_last,
              "bounded": _totals(bounded), "every": _totals(every)}
    bounded.clear()
    result["cleared"] = (list(bounded.rows), bounded.calls(), bounded.bytes(), bounded.seconds(), bounded.by_op())
    with comm.record(bounded), comm.record() as after:  # after clear(): counts from zero again
        _collectives(12)
    result["after_clear"], result["after_every"] = _totals(bounded), _totals(after)
    return result


def test_comm_ledger_bounded_totals_equal_unbounded_over_real_collectives():
    for r in run_on_ranks(_bounded_beside_unbounded, 2):
        assert r["calls"] == 300 and r["window_is_last"]
        _assert_same_totals(r["bounded"], r["every"])
        assert r["cleared"] == ([], 0, 0, 0, {})
        _assert_same_totals(r["after_clear"], r["after_every"])


def test_comm_ledger_bounded_folds_rows_in_first_seen_order():
    rows = [comm.Row(op, 10 * (i + 1), 4, "float32", 0.5) for i, op in
            enumerate(["broadcast", "all_reduce", "broadcast", "all_gather", "all_reduce"])]
    bounded, every = comm.Ledger(rows, max_rows=2), comm.Ledger(list(rows))
    assert list(bounded.rows) == rows[-2:]
    assert list(bounded.by_op()) == ["broadcast", "all_reduce", "all_gather"]
    assert bounded.by_op() == every.by_op() and bounded.bytes("broadcast") == 40 and bounded.calls() == 5
    with pytest.raises(ValueError, match="max_rows"):
        comm.Ledger(max_rows=0)


def _engine_steps(steps: int):
    cfg = GPTConfig(vocab_size=61, max_seq_len=8, n_layer=3, n_head=4, n_kv_head=2, d_model=16, ffn_hidden=24,
                    tie_embeddings=True)
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 3}}
    saved, engine_module.COMM_LEDGER_MAX_ROWS = engine_module.COMM_LEDGER_MAX_ROWS, WINDOW
    try:
        engine = ts.initialize(GPT(cfg, seed=5, dtype=torch.float64), config)
    finally:
        engine_module.COMM_LEDGER_MAX_ROWS = saved
    ledger = engine.comm_ledger
    ledger.clear()  # from here on, every row the engine's ledger gets is also kept in `seen`
    seen: list[comm.Row] = []
    append = ledger.append
    ledger.append = lambda row: (seen.append(row), append(row))
    for batch in synthetic_token_batches(num_batches=steps, batch_size=8, seq_len=8, vocab_size=61, seed=2):
        engine.train_batch(batch)
    window_is_last = len(ledger.rows) == WINDOW and all(a is b for a, b in zip(ledger.rows, seen[-WINDOW:]))
    return ledger.max_rows, len(seen), window_is_last, _totals(ledger), _totals(comm.Ledger(seen))


def test_comm_ledger_engine_keeps_the_window_and_counts_every_call():
    steps = 3
    for max_rows, calls, window_is_last, bounded, every in run_on_ranks(_engine_steps, 2, steps):
        assert max_rows == WINDOW and window_is_last
        assert calls > 2 * WINDOW  # rows left the window: the totals below include folded ones
        _assert_same_totals(bounded, every)
