"""Rank functions for notebooks/08-pipeline-parallel.ipynb (lesson 8, "Pipeline parallelism").

`tinyscale.dist.launch` starts every rank as a fresh process, which finds a function only by
importing it, so everything that runs on ranks lives here, at module level. The whole world is
one pipeline (rank r holds stage r, and stage r + p for interleaving). What they measure:

- `timed_rounds`: steps of several schedules on tinyscale.pipeline's executor, taking turns, each
  recorded by `tinyscale.pipeline.replay.StepTimer`: each compute action's start and end on a
  clock shared by the ranks (`time.perf_counter`: CLOCK_MONOTONIC, one per machine) and what
  each send and receive held its rank for, after a warm-up round;
- `latency`: one activation-sized message's one-way time (half a ping-pong);
- `peak_saved_bytes`: the peak bytes of activations kept for backward on this rank during one
  step (what 1F1B saves over AFAB).

`run_many` runs several of them in one launch (starting ranks costs seconds).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig
from tinyscale.pipeline import (
    GPTStage, PipelineExecutor, add_communication, afab, gpt_loss, interleaved_1f1b, one_f_one_b,
    partition_gpt, stages_on_rank, zb_h1,
)
from tinyscale.pipeline.replay import StepTimer, message_latency

SCHEDULES = {
    "afab": lambda p, m, v: afab(p, m),
    "1f1b": lambda p, m, v: one_f_one_b(p, m),
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": lambda p, m, v: zb_h1(p, m),
}
ROWS, T = 2, 32  # rows per micro-batch, tokens per row


def config(n_layer: int = 4) -> GPTConfig:
    """Big enough that a block's forward (a few ms on one core) dwarfs a message on gloo."""
    return GPTConfig(vocab_size=128, max_seq_len=T, n_layer=n_layer, n_head=4, d_model=128, ffn_hidden=384)


def make_executor(name: str, m: int, v: int = 1, n_layer: int = 4, dtype=torch.float32):
    """This rank's executor for schedule `name`, its model and a batch of m micro-batches."""
    torch.set_num_threads(1)
    p, rank = dist.get_world_size(), dist.get_rank()
    model = GPT(config(n_layer), seed=0, dtype=dtype)
    stages = {spec.stage: GPTStage(model, spec)
              for spec in stages_on_rank(partition_gpt(model.config, p, virtual_stages=v), rank)}
    executor = PipelineExecutor(add_communication(SCHEDULES[name](p, m, v)), rank, stages, loss_fn=gpt_loss)
    (inputs, targets), = synthetic_token_batches(num_batches=1, batch_size=ROWS * m, seq_len=T,
                                                 vocab_size=128, seed=1)
    return executor, model, inputs.chunk(m), targets.chunk(m)


def timed_rounds(configs: list[tuple[str, int, int]], rounds: int = 5, n_layer: int = 4) -> list[list[tuple]]:
    """For each (schedule, m, v): this rank's `StepTimer` record (computes, holds, waits,
    send_waits, wall) of each of `rounds` steps; the configurations take turns, one step each
    per round (a change of load hits them alike), after a warm-up round (allocators, gloo's
    connections)."""
    runs = [make_executor(name, m, v, n_layer) for name, m, v in configs]
    timers = [StepTimer(executor) for executor, *_ in runs]
    records: list[list[tuple]] = [[] for _ in configs]
    for k in range(rounds + 1):
        for (executor, model, inputs, targets), timer, record in zip(runs, timers, records):
            model.zero_grad()
            dist.barrier()
            with timer.timing():
                executor.run(inputs, targets)
            if k:
                record.append((timer.computes, timer.holds, timer.waits, timer.send_waits, timer.wall))
    return records


def latency() -> float:
    """One-way seconds of one activation-sized message (a frame: rows x T x C and its status element)."""
    return message_latency(ROWS * T * config().d_model + 1)


def peak_saved_bytes(name: str, m: int, v: int = 1, n_layer: int = 4) -> int:
    """Peak bytes of activations this rank keeps for backward during one step: every tensor
    autograd saves (parameters excluded), counted from when it is saved until its storage dies."""
    executor, model, inputs, targets = make_executor(name, m, v, n_layer)
    weights = {q.untyped_storage().data_ptr() for q in model.parameters()}
    live, peak, seen = [0], [0], set()

    def freed(key: int, nbytes: int) -> None:
        seen.discard(key)
        live[0] -= nbytes

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in weights and key not in seen:
            seen.add(key)
            live[0] += storage.nbytes()
            peak[0] = max(peak[0], live[0])
            weakref.finalize(storage, freed, key, storage.nbytes())
        return t.detach()  # not t: a saved output would hold its own node (tests/planner/activations.py)

    dist.barrier()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        executor.run(inputs, targets)
    return peak[0]


def run_many(calls: list[tuple[str, tuple]]) -> list:
    """Run several of this module's functions in one launch: [(name, args)] -> [result]."""
    return [globals()[name](*args) for name, args in calls]
