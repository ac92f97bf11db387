"""A step that raised on some ranks: who failed, agreed over the world, and what the others raise.

Both the data-parallel step (`engine/engine.py`) and the pipeline's (`engine/pipeline_step.py`)
use these, so neither imports the other. Tests: `pytest -k failed_step`.

Under tensor or context parallelism a rank can raise mid-forward while its peers wait inside
one of the model's collectives, which it will never join. `FailureWatch` makes that end in a
bounded time: a rank that raised posts so in the store (`post`); every wait on the model's
groups (tp, cp) polls the store and gives up, raising `PeerFailed`, when a member of the
group it waits on has posted (`comm.watch`), and posts in turn (its own peers may wait for it); then every rank agrees over a gloo group of its own (`agree`), never
over the model's groups, which may now be out of step. If no rank gave up a collective, the
step is dropped and training can go on; if one did, the model's groups are unusable: the
engine stops on every rank, naming the rank that raised. Waits on NCCL groups are not
watched (NCCL's own timeout and abort handle them). Tests: `pytest -k failure_agreement`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from tinyscale.dist import comm


class StepFailed(RuntimeError):
    """Another rank's forward or backward raised; every rank dropped the step (retry or skip it)."""


class PeerFailed(StepFailed):
    """This rank gave up waiting in a collective: the rank named raised and will not join it."""


def failed_ranks(failed_here: bool, device: torch.device) -> list[int]:
    """The global ranks whose forward or backward raised this step, agreed over the whole world
    (one all-reduce of a flag per rank): under tensor or pipeline parallelism a rank's failure
    must stop its TP and pp peers as well as its dp peers, or the shards of one model would step apart."""
    flags = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    flags[dist.get_rank()] = float(failed_here)
    comm.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]


_side_groups: dict[int, object] = {}


def _side_group():
    """A gloo group over the world used for nothing but agreeing on failures (made once)."""
    key = id(dist.group.WORLD)
    if key not in _side_groups:
        _side_groups[key] = dist.new_group(backend="gloo")
    return _side_groups[key]


# --8<-- [start:failure-watch]
class FailureWatch:
    """One per engine, built on every rank (collective): watches `groups` (the model's) during
    each attempt at a step, and agrees on failures over its own gloo group."""

    def __init__(self, groups: list):
        self.side = _side_group()
        # this engine's keys in the store (os.urandom: torch's generator must not move, dropout draws from it)
        token = torch.tensor([int.from_bytes(os.urandom(7), "little")], dtype=torch.int64)
        dist.broadcast(token, src=0, group=self.side)
        self.prefix = f"tinyscale/failed/{int(token)}"
        self.store = dist.distributed_c10d._get_default_store()
        self.groups = frozenset(id(g) for g in groups if g is not None and dist.get_backend(g) == "gloo")
        self.attempt = 0
        self.current: comm.Watch | None = None

    def covers(self, group) -> bool:
        return id(dist.group.WORLD if group is None else group) in self.groups

    @contextlib.contextmanager
    def attempt_step(self) -> Iterator[comm.Watch]:
        """Watch the model's groups for one attempt at a step (a retried step is a new attempt)."""
        self.attempt += 1
        me = dist.get_rank()

        def poll(group) -> None:
            for rank in dist.get_process_group_ranks(group or dist.group.WORLD):
                if rank != me and self.store.check([f"{self.prefix}/{self.attempt}/{rank}"]):
                    raise PeerFailed(f"rank {rank} raised (or gave up) while rank {me} waited for it in a "
                                     "collective of the model")
        self.current = comm.Watch(self.groups, poll)
        with comm.watch(self.current) as w:
            yield w

    def post(self) -> None:
        """This rank raised, or gave up waiting: its peers must not wait for it (call at once)."""
        if self.current is not None:
            self.store.set(f"{self.prefix}/{self.attempt}/{dist.get_rank()}", "1")

    def agree(self, error: BaseException | None) -> tuple[list[int], list[int]]:
        """(ranks that raised, ranks that gave up a collective), the same on every rank: one
        all-reduce of a flag per rank (1: raised, 2: gave up, 3: both) over the side group."""
        flags = torch.zeros(dist.get_world_size(), dtype=torch.float64)
        flags[dist.get_rank()] = (float(error is not None and not isinstance(error, PeerFailed))
                                  + 2.0 * float(self.current is not None and self.current.abandoned))
        comm.all_reduce(flags, group=self.side)  # not a watched group: never given up
        codes = [int(f) for f in flags.tolist()]
        return [r for r, c in enumerate(codes) if c & 1], [r for r, c in enumerate(codes) if c & 2]
# --8<-- [end:failure-watch]


def broken_message(step: int, failed: list[int], abandoned: list[int]) -> str:
    return (f"train_batch: step {step} raised on rank(s) {failed} (see the error there) while rank(s) "
            f"{abandoned} waited for it inside the model's collectives; those cannot be resumed, so this "
            "engine cannot continue: start a new engine from the last checkpoint")
