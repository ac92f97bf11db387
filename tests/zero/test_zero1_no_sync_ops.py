"""ZeroStage1's gradient hook under no_sync: what it adds to a backward, counted with a dispatch mode.

Each tensor operation launched from Python between autograd's kernels costs far more than its
bytes (lesson 02, "Four ranks"). Under `no_sync` the first micro-batch's hook moves each gradient
into its slot of the unit's flat buffer (one `copy_` a parameter); after that `.grad` is the slot
and autograd adds the next micro-batches into it, so their hooks only mark the parameter used:
no tensor operation at all. Counted as the difference between a backward with ZeroStage1's hooks
and the same backward of a plain model holding its own `.grad` (autograd's operations cancel out).
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from tinyscale.data import synthetic_token_batches
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import CountOps, run_on_ranks


def _ops_of_no_sync_backwards():
    """(operations ZeroStage1's hooks add to the first and to the second no_sync backward, parameters)."""
    from tinyscale.zero import ZeroStage1

    cfg = GPTConfig.preset("tiny")
    plain, model = GPT(cfg, seed=0, dtype=torch.float64), GPT(cfg, seed=0, dtype=torch.float64)
    zero = ZeroStage1(list(model.parameters()), lambda groups: torch.optim.SGD(groups, lr=0.1), bucket_bytes=20_000)
    assert len(zero.sharded.units) >= 3  # several units, several parameters in each
    ((x, y),) = synthetic_token_batches(num_batches=1, batch_size=2 * dist.get_world_size(), seq_len=16, seed=0)
    rows = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    added = []
    for _ in range(2):  # two micro-batches, both under no_sync
        counts = []
        for net, context in ((model, zero.no_sync), (plain, None)):
            loss = net(x[rows], y[rows])
            count = CountOps()
            if context is None:
                with count:
                    loss.backward()
            else:
                with context(), count:
                    loss.backward()
            counts.append(count.ops)
        added.append(counts[0] - counts[1])
        assert not counts[1] - counts[0]  # (the hooks remove nothing autograd does)
    zero.step()  # (reduces what the two accumulated: the ranks' collectives match)
    return added, sum(len(unit.params) for unit in zero.sharded.units)


def test_zero1_no_sync_hook_copies_once_then_makes_no_operation():
    """On 2 ranks: the first no_sync backward adds one `copy_` per parameter (into its slot) and
    each unit's flat buffer (`empty`, its padding zeroed, the slots as views); the second adds
    nothing (the hook compares addresses; making the slot's view to compare, as before, added a
    `slice` and a `view` per parameter)."""
    for (first, second), params in run_on_ranks(_ops_of_no_sync_backwards, 2):
        assert first["aten.copy_.default"] == params, first
        assert second == Counter(), second
