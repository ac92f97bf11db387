"""Compression on ranks: ledger bytes equal each payload's formula, the hooks work in torch's
DDP and in ours, our PowerSGD equals torch's `powerSGD_hook`, 1-bit Adam equals AdamW while
warming up and then sends one bit per element. Run: `pytest -k compression`.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

from tinyscale.compression import (
    QSGD, BlockInt8, CompressionState, OneBitAdam, PowerSGDState, RandomK, TopK, compressed_mean, compression_hook,
    onebit_bytes, powersgd_hook,
)
from tinyscale.data_parallel import BucketedDDP
from tinyscale.dist import comm
from tinyscale.testing import run_on_ranks

COMPRESSORS = {"topk": lambda: TopK(0.3), "randomk": lambda: RandomK(0.3, seed=5), "qsgd8": lambda: QSGD(8, seed=2),
               "qsgd4": lambda: QSGD(4, seed=2), "blockint8": lambda: BlockInt8(16)}


def _mean_body(name: str, n: int):
    comp = COMPRESSORS[name]()
    x = torch.randn(n, generator=torch.Generator().manual_seed(dist.get_rank()), dtype=torch.float64)
    with comm.record() as ledger:
        out = compressed_mean(x, comp, None)
    return out, sum(r.bytes for r in ledger.rows), comp.ledger_bytes(n, x.dtype, dist.get_world_size())


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_compression_ledger_bytes_equal_the_payload_formula(world, name):
    n = 37  # odd: int4 packs a half byte of padding, top-k rounds k up
    results = run_on_ranks(_mean_body, world, name, n)
    for out, measured, formula in results:
        assert measured == formula
        assert torch.equal(out, results[0][0])  # every rank ends with the same mean
    one_rank = COMPRESSORS[name]().wire_bytes(n, torch.float64)
    assert one_rank < n * 8  # fewer bytes than the float64 gradient itself


def _exact_at_full_ratio_body():
    x = torch.randn(20, generator=torch.Generator().manual_seed(dist.get_rank()), dtype=torch.float64)
    exact = x.clone()
    dist.all_reduce(exact)
    return compressed_mean(x, TopK(1.0)), compressed_mean(x, RandomK(1.0)), exact / dist.get_world_size()


def test_compression_sparsifiers_at_ratio_one_are_the_exact_mean():
    for topk, randomk, exact in run_on_ranks(_exact_at_full_ratio_body, 3):
        # 1e-14: the same 3 numbers added in a different order (gather-then-sum vs all-reduce) in float64
        torch.testing.assert_close(topk, exact, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(randomk, exact, rtol=1e-14, atol=1e-14)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 8)).double()


def _train(wrapped: nn.Module, steps: int) -> list[list[torch.Tensor]]:
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    seen = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x, y = torch.randn(6, 12, generator=g, dtype=torch.float64), torch.randn(6, 8, generator=g, dtype=torch.float64)
        loss = ((wrapped(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen.append([p.detach().clone() for p in wrapped.parameters()])
    return seen


def _powersgd_body(rank: int, rate: float, steps: int):
    def state():
        return dict(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                    min_compression_rate=rate, random_seed=3)
    theirs = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=100)
    theirs.register_comm_hook(torch_psgd.PowerSGDState(**state()), torch_psgd.powerSGD_hook)
    ours_in_torch = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=100)
    ours_in_torch.register_comm_hook(PowerSGDState(**state()), powersgd_hook)
    ours = BucketedDDP(_model(), bucket_cap_mb=100)
    ours.register_comm_hook(PowerSGDState(**state()), powersgd_hook)
    plain = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=100)
    return _train(theirs, steps), _train(ours_in_torch, steps), _train(ours, steps), _train(plain, steps)


@pytest.mark.parametrize(("rank", "rate"), [(1, 2.0), (3, 1.0)], ids=["rank1_gram_schmidt", "rank3_qr"])
def test_compression_powersgd_hook_equals_torchs_powersgd_hook(rank, rate):
    steps = 5  # 2 plain all-reduce steps, then 3 compressed with warm start and error feedback
    for theirs, ours_in_torch, ours, plain in run_on_ranks(_powersgd_body, 2, rank, rate, steps):
        for step in range(steps):
            for a, b, c in zip(theirs[step], ours_in_torch[step], ours[step]):
                # 1e-12: the same float64 math, grouped differently (torch batches P and Q as (1, n, r))
                torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(c, a, rtol=1e-12, atol=1e-12)
        # the compressed steps really are compressed: they leave the uncompressed run
        assert max((a - p).abs().max().item() for a, p in zip(theirs[-1], plain[-1])) > 1e-6


def test_compression_powersgd_at_full_rank_is_the_exact_mean():
    # rank = min(n, m) and every matrix compressed: P P^T projects onto the mean's column space,
    # so the "approximation" is the mean itself, up to rounding.
    for theirs, ours_in_torch, ours, plain in run_on_ranks(_powersgd_body, 2, 10, 0.0, 4):
        for a, p in zip(ours[-1], plain[-1]):
            # 1e-10: QR and two float64 matmuls on 10 x 12 matrices (condition numbers ~10) per step, 4 steps
            torch.testing.assert_close(a, p, rtol=1e-10, atol=1e-10)


def _topk_hook_body(steps: int):
    theirs = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=100)
    theirs.register_comm_hook(CompressionState(TopK(0.2)), compression_hook)
    ours = BucketedDDP(_model(), bucket_cap_mb=100)
    ours.register_comm_hook(CompressionState(TopK(0.2)), compression_hook)
    with comm.record() as ledger:
        trained = _train(ours, steps)
    return _train(theirs, steps), trained, ledger.calls("all_gather"), ledger.calls("all_reduce")


def test_compression_topk_hook_trains_the_same_in_torchs_ddp_and_ours():
    steps = 3
    for theirs, ours, gathers, reduces in run_on_ranks(_topk_hook_body, 2, steps):
        for step in range(steps):
            for a, b in zip(theirs[step], ours[step]):
                torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)  # float64, same sums in another order
        assert gathers == 2 * steps  # values and indices, once per step (one bucket)
        assert reduces == steps  # only the usage flags: gradients never go through an all-reduce


def _onebit_body(freeze: int, steps: int):
    torch.manual_seed(0)
    shapes = [(5, 3), (4,), (7,)]
    params = [nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in shapes]
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    ours = OneBitAdam(params, lr=0.01, weight_decay=0.1, freeze_step=freeze)
    adamw = torch.optim.AdamW(ref, lr=0.01, weight_decay=0.1, foreach=False)
    world, out, byte_counts = dist.get_world_size(), [], []
    for step in range(steps):
        grads = [[torch.randn(s, generator=torch.Generator().manual_seed(1000 * step + 10 * r + i), dtype=torch.float64)
                  for i, s in enumerate(shapes)] for r in range(world)]
        for i, p in enumerate(params):
            p.grad = grads[dist.get_rank()][i]
            ref[i].grad = sum(g[i] for g in grads) / world
        with comm.record() as ledger:
            ours.step()
        adamw.step()
        byte_counts.append((sum(r.bytes for r in ledger.rows), ledger.calls("all_reduce")))
        out.append(([p.detach().clone() for p in params], [p.detach().clone() for p in ref]))
    return out, byte_counts


def test_compression_onebit_adam_equals_adamw_in_warmup_then_sends_one_bit():
    freeze, steps, world = 3, 6, 3
    results = run_on_ranks(_onebit_body, world, freeze, steps)
    n = 5 * 3 + 4 + 7
    for out, byte_counts in results:
        for step in range(freeze):
            for a, b in zip(*out[step]):
                # 1e-12: the mean gradient summed in another order (all-reduce of g / N vs sum / N), float64
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        # one exact all-reduce: the gradients and a usage flag per parameter (3)
        assert all(count == ((n + 3) * 8, 1) for count in byte_counts[:freeze])
        assert all(count == (onebit_bytes(n, world, torch.float64), 0) for count in byte_counts[freeze:])
        # At this tiny n the per-chunk scales dominate; at scale the signs do: ~1/16 of an fp32 all-reduce's size
        assert onebit_bytes(30_000, world, torch.float32) * 15 < 30_000 * 4
        for a, b in zip(out[-1][0], results[0][0][-1][0]):
            assert torch.equal(a, b)  # every rank holds the same parameters after compressed steps
        assert max((a - b).abs().max().item() for a, b in zip(*out[-1])) > 1e-8  # compressed: not AdamW any more
