"""A rank raising mid-forward while its peers wait inside the model's collectives ends in a
bounded time, on every rank, with the failing rank named (`pytest -k failure_agreement`).

Under tensor or context parallelism the failing rank never joins its peers' next collective.
Each case plants a failure in the second layer's forward on one rank (the first layer's
collectives done, the rest not) and checks: the failing rank raised its own error, every other
rank raised `StepFailed` naming it (its peers gave up their collective, so the engine says it
cannot continue), and every rank's `train_batch` returned well within the bound. Without the
agreement (engine/step_failure.py) the peers wait until the pool's deadline, or gloo reports a
collective mismatch. Layouts: tp 2 and cp 2 (world 2), dp 2 x tp 2 and pp 2 x tp 2 (world 4,
one run); after each run the pool is restarted: the groups a failure left out of step must
not serve a later test.
A failure after the last collective of the step is still dropped and retried:
`pytest -k tensor_parallel_failed_step`.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import run_on_ranks
from tinyscale.testing.pool import get_pool

GPT_CONFIG = GPTConfig(vocab_size=32, max_seq_len=8, n_layer=2, n_head=2, d_model=16, ffn_hidden=24)
DEADLINE_S = 60  # the pool's limit for the run: a hang reaches it
BOUND_S = 10  # each train_batch: the agreement polls every 50 ms; 10 s leaves room for a loaded machine


def _one_case(parallel: dict, failing: int):
    engine = ts.initialize(GPT(GPT_CONFIG, seed=1, dtype=torch.float64), {
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "parallel": parallel})
    blocks = [m for n, m in engine.model.named_modules() if n.split(".")[-2:] == ["blocks", "1"]]

    def boom(module, args):
        raise MemoryError(f"simulated: rank {dist.get_rank()} mid-forward")
    if dist.get_rank() == failing:
        blocks[0].register_forward_pre_hook(boom)
    batch = synthetic_token_batches(num_batches=1, batch_size=4, seq_len=8, vocab_size=32, seed=2)[0]
    start = time.monotonic()
    try:
        engine.train_batch(batch)
        raised = ("", "")
    except Exception as exc:  # noqa: BLE001 - the test asserts which
        raised = (type(exc).__name__, str(exc))
    return (*raised, time.monotonic() - start)


def _cases_body(cases: list[tuple[dict, int]]):
    return [_one_case(parallel, failing) for parallel, failing in cases]


# (world, [(parallel, failing rank)]): a world-sized tp or cp group is torch's default group,
# which a failure leaves out of step, so tp 2 and cp 2 run apart; world 4's tp groups are new.
RUNS = [(2, [({"tensor": 2}, 1)]), (2, [({"context": 2}, 0)]),
        (4, [({"tensor": 2}, 1), ({"tensor": 2, "pipeline": 2}, 3)])]  # world 4, tp 2: dp 2 x tp 2


@pytest.mark.parametrize(("world", "cases"), RUNS, ids=["tp2", "cp2", "dp2xtp2-pp2xtp2"])
def test_failure_agreement_mid_forward_ends_in_bounded_time_naming_the_rank(world, cases):
    try:
        results = run_on_ranks(_cases_body, world, cases, timeout_s=DEADLINE_S)
    finally:
        get_pool(world).close()  # the failed cases' groups are out of step: fresh ranks next time
    for case, (parallel, failing) in enumerate(cases):
        for rank, per_case in enumerate(results):
            name, message, seconds = per_case[case]
            assert seconds < BOUND_S, (parallel, rank, seconds)
            if rank == failing:
                assert name == "MemoryError", (parallel, rank, name, message)
            else:
                assert name == "StepFailed", (parallel, rank, name, message)
                assert f"raised on rank(s) [{failing}]" in message and "cannot continue" in message, message


def _slow_peer_messages(ops: str) -> list[float]:
    """Rank 1 sends 3 messages, each 0.3 s late (6 poll intervals); rank 0 receives them watched."""
    from tinyscale.dist import comm

    w = comm.Watch(frozenset({id(dist.group.WORLD)}), poll=lambda group: None)
    got = []
    with comm.watch(w):
        for i in range(3):
            t = torch.full((64,), float(i))
            if dist.get_rank() == 1:
                time.sleep(0.3)
                comm.send(t, 0) if ops == "blocking" else comm.isend(t, 0).wait()
            else:
                t.zero_()
                comm.recv(t, 1) if ops == "blocking" else comm.irecv(t, 1).wait()
                got.append(float(t[0]))
            comm.all_reduce(t)  # a watched collective after each message, waiting on the sleeper too
    return got


@pytest.mark.parametrize("ops", ["blocking", "async"])
def test_failure_agreement_watched_p2p_survives_a_slow_peer(ops):
    """A gloo send/recv whose wait(timeout) expires closes its connection, so polling them that
    way broke every later message between the two ranks whenever one was merely slow (a loaded
    machine): ring attention failed with 'Connection closed by peer' with no rank at fault. The
    watch waits for them in a thread instead; three late messages in a row all arrive."""
    results = run_on_ranks(_slow_peer_messages, 2, ops, timeout_s=DEADLINE_S)
    assert results[0] == [0.0, 1.0, 2.0]
