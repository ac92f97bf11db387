"""`tinyscale train --resume-on-failure N`: a rank killed mid-run, the ranks relaunched from the
latest complete checkpoint, and the run continues bit for bit (key: resume_on_failure).

Rank 1 exits (`os._exit`, no exception, no goodbye: a killed process) in its third step; the
launcher ends rank 0; `train_with_recovery` relaunches both with `resume=True`, they load the
checkpoint of step 2 and train steps 2 and 3. The final parameters and the last losses are
`torch.equal` to an uninterrupted run's. That test spawns the ranks twice (a killed rank cannot
come back to a pool) and took 249 s on the shared 2-core machine under load: --thorough. The
default suite keeps the restart logic's test (launch replaced by a failing stub).
`elastic_world_sizes` (key: elastic): the world sizes a restart may take with the global batch
unchanged, none missed and none wrong, checked by brute force.
Run: `pytest -k "resume_on_failure or elastic"` (--thorough for the killed rank).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch

from tinyscale.recovery import elastic_world_sizes, train_with_recovery
from tinyscale.testing import run_on_ranks
from tinyscale.train import make_spec, train_rank

CRASH_AT_CALL = 3  # the third train_batch: steps 0 and 1 are checkpointed, step 2 is lost


def _killed_once(marker: str, spec):
    """train_rank, except that rank 1 dies in its CRASH_AT_CALL-th step the first time round."""
    import tinyscale as ts
    from tinyscale.engine.engine import Engine

    if not os.path.exists(marker):
        train_batch, calls = Engine.train_batch, [0]

        def dying(self, batch):
            calls[0] += 1
            if calls[0] == CRASH_AT_CALL and ts.dist.rank() == 1:
                open(marker, "w").close()
                os._exit(3)  # a killed process: no exception, no cleanup
            return train_batch(self, batch)

        Engine.train_batch = dying
    return train_rank(spec)


def _spec(save_dir):
    spec = make_spec("ddp", world_size=2, steps=4, save_dir=str(save_dir), save_every=1)
    return dataclasses.replace(spec, show_progress=False)


@pytest.mark.thorough
def test_resume_on_failure_continues_bit_for_bit_after_a_rank_is_killed(tmp_path):
    logs = []
    result, restarts = train_with_recovery(_spec(tmp_path / "ck"), max_restarts=2, timeout_s=300,
                                           rank_fn=functools.partial(_killed_once, str(tmp_path / "killed")),
                                           log=logs.append)
    assert (tmp_path / "killed").exists() and restarts == 1 and "restart 1 of 2" in logs[0]
    straight = run_on_ranks(train_rank, 2, _spec(tmp_path / "straight"), timeout_s=300)[0]
    assert [m["step"] for m in result["metrics"]] == [2, 3]  # resumed at the checkpoint of step 2
    assert [m["loss"] for m in result["metrics"]] == [m["loss"] for m in straight["metrics"][2:]]
    for name, value in straight["state"].items():
        assert torch.equal(result["state"][name], value), name


def test_resume_on_failure_gives_up_after_n_restarts_or_without_checkpoints(tmp_path, monkeypatch):
    spec = _spec(tmp_path / "ck")
    with pytest.raises(ValueError, match="--save-every"):
        train_with_recovery(dataclasses.replace(spec, save_every=0), max_restarts=1)
    calls = []

    def failing(fn, world, *args, timeout_s):
        calls.append(args[0].resume)
        (tmp_path / "ck").mkdir(exist_ok=True)
        (tmp_path / "ck" / "v000001").mkdir(exist_ok=True)
        raise RuntimeError("rank 1 died")

    import tinyscale.dist

    monkeypatch.setattr(tinyscale.dist, "launch", failing)
    with pytest.raises(RuntimeError, match="rank 1 died"):
        train_with_recovery(spec, max_restarts=2, log=lambda s: None)
    assert calls == [False, True, True]  # the first launch, then 2 restarts, each resuming
    calls.clear()
    with pytest.raises(RuntimeError):  # nothing in its save_dir to resume from: no restart
        train_with_recovery(_spec(tmp_path / "empty"), max_restarts=2, log=lambda s: None)
    assert calls == [False]


def test_elastic_world_sizes_keep_the_global_batch_and_miss_none():
    # 12 = dp x b x accumulation with b in {2, 3}: dp 5 fits neither; the largest b that fits is taken
    assert elastic_world_sizes(12, [2, 3]) == [(1, 3, 4), (2, 3, 2), (3, 2, 2), (4, 3, 1), (6, 2, 1)]
    # Llama 2's 1,024 sequences on tp 4 x pp 4 (lesson 12): 512 to 1,024 GPUs
    assert elastic_world_sizes(1024, [1], min_gpus=512, max_gpus=1024, model_parallel=16) == [
        (512, 1, 32), (1024, 1, 16)]
    for batch in range(1, 25):  # brute force: gpus is valid iff some (b, accumulation) makes the batch
        for mbs in ([1], [2], [2, 3], [4, 6], [8]):
            for mp in (1, 2, 4):
                got = {g: (b, a) for g, b, a in elastic_world_sizes(batch, mbs, model_parallel=mp, min_gpus=2,
                                                                     max_gpus=3 * mp * 4)}
                for gpus in range(1, 3 * mp * 4 + 2):
                    ways = [(b, a) for b in mbs for a in range(1, batch + 1)
                            if gpus % mp == 0 and (gpus // mp) * b * a == batch]
                    in_range = 2 <= gpus <= 3 * mp * 4
                    assert (gpus in got) == (bool(ways) and in_range), (batch, mbs, mp, gpus)
                    if gpus in got:
                        assert got[gpus] == max(ways), (batch, mbs, mp, gpus)
    with pytest.raises(ValueError, match="micro_batches"):
        elastic_world_sizes(8, [])


def test_elastic_cli_lists_the_gpu_counts(capsys):
    from tinyscale.cli import main

    assert main(["elastic", "--global-batch", "12", "--micro-batches", "2,3", "--model-parallel", "2"]) == 0
    rows = [line.split("│")[1:5] for line in capsys.readouterr().out.splitlines() if line.count("│") == 5]
    assert [[int(c) for c in r] for r in rows] == [[2, 1, 3, 4], [4, 2, 3, 2], [6, 3, 2, 2], [8, 4, 3, 1],
                                                   [12, 6, 2, 1]]
    assert main(["elastic", "--global-batch", "12", "--micro-batches", "5"]) == 1  # no count keeps it
