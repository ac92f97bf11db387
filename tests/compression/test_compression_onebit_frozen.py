"""1-bit Adam once its variance is frozen (`pytest -k compression_onebit`).

- the two-phase compressed all-reduce loses nothing, it only delays: over K calls the sum of
  its outputs equals the sum of the inputs' means minus the mean of the ranks' final worker
  errors minus the final server errors (each rank's chunk). Dropping either error update
  breaks the identity (the server error's: a residual ~1 instead of ~1e-16);
- a parameter no rank used in the warm-up has no variance to freeze: from the first step a
  rank uses it after the freeze it trains exactly as AdamW (its gradient all-reduced exactly),
  while the others go on compressed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from tinyscale.compression import OneBitAdam
from tinyscale.compression.onebit import compressed_allreduce
from tinyscale.testing import run_on_ranks

WORLD, N, CALLS = 3, 12, 5  # N: a multiple of WORLD (4 elements per chunk)


def _allreduce_body():
    rank = dist.get_rank()
    worker, server = torch.zeros(N, dtype=torch.float64), torch.zeros(N // WORLD, dtype=torch.float64)
    inputs, outputs = [], []
    for k in range(CALLS):
        x = torch.randn(N, generator=torch.Generator().manual_seed(100 * k + rank), dtype=torch.float64)
        inputs.append(x)
        outputs.append(compressed_allreduce(x.clone(), worker, server))
    return inputs, outputs, worker, server


def test_compression_onebit_compressed_allreduce_sum_of_outputs_is_the_mean_less_both_errors():
    results = run_on_ranks(_allreduce_body, WORLD)
    for _, outputs, _, _ in results:  # every rank holds the same output
        assert all(torch.equal(o, a) for o, a in zip(outputs, results[0][1]))
    inputs = [r[0] for r in results]
    mean_inputs = sum(sum(x[k] for x in inputs) for k in range(CALLS)) / WORLD
    mean_worker = sum(r[2] for r in results) / WORLD
    server = torch.cat([r[3] for r in results])  # rank j's server error is chunk j's
    residual = (sum(results[0][1]) - (mean_inputs - mean_worker - server)).abs().max().item()
    # float64, 5 calls of sums over 3 ranks of values ~1: rounding ~1e-15; a dropped error update leaves ~1
    assert residual < 1e-12, residual
    assert server.abs().max() > 1e-3 and mean_worker.abs().max() > 1e-3  # both errors really are nonzero


SHAPES = [(5, 3), (4,), (6,)]  # the last: no rank uses it in the warm-up
FREEZE, STEPS = 2, 5


def _late_body():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in SHAPES]
    late, late_ref = params[-1], nn.Parameter(params[-1].detach().clone())
    ours = OneBitAdam(params, lr=0.01, weight_decay=0.1, freeze_step=FREEZE)
    adamw = torch.optim.AdamW([late_ref], lr=0.01, weight_decay=0.1, foreach=False)
    world, trace = dist.get_world_size(), []
    for step in range(STEPS):
        grads = [[torch.randn(s, generator=torch.Generator().manual_seed(1000 * step + 10 * r + i), dtype=torch.float64)
                  for i, s in enumerate(SHAPES)] for r in range(world)]
        for i, p in enumerate(params):
            p.grad = grads[dist.get_rank()][i]
        # the late parameter: unused during the warm-up and at step 3 (by every rank), used by rank 1 only at step 4
        uses = [False] * world if step < FREEZE or step == 3 else [True] * world if step == 2 else [r == 1 for r in range(world)]
        late.grad = grads[dist.get_rank()][-1] if uses[dist.get_rank()] else None
        late_ref.grad = None if not any(uses) else sum(g[-1] for g, u in zip(grads, uses) if u) / world
        ours.step()
        adamw.step()
        trace.append((late.detach().clone(), late_ref.detach().clone(), params[0].detach().clone()))
    return trace


def test_compression_onebit_parameter_first_used_after_the_freeze_trains_as_adamw():
    results = run_on_ranks(_late_body, WORLD)
    start = results[0][0][0]
    for trace in results:
        for step, (late, late_ref, _) in enumerate(trace):
            # 1e-12: float64, the mean gradient summed in another order (all-reduce of g / N vs sum / N)
            torch.testing.assert_close(late, late_ref, rtol=1e-12, atol=1e-12, msg=f"step {step}")
        assert not torch.equal(trace[-1][0], start) and torch.equal(trace[1][0], start)  # stepped only once used
        assert all(torch.equal(a[2], b[2]) for a, b in zip(trace, results[0]))  # the compressed ones agree
