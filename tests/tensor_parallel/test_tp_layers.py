"""Tensor-parallel building blocks against their definitions and the dense layers (float64).

The conjugate operators (f, g, the hidden-dim and sequence-dim gathers and scatters), the column-
and row-parallel linears (with and without sequence parallelism), the vocab-parallel embedding
and cross-entropy: forward values and every gradient equal the dense computation's, on 2, 3 and
4 ranks, with a vocab that does not divide. Run: `pytest tests/tensor_parallel -k "tp_comm or
tp_column or sp_ or vocab_parallel"`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tinyscale.models.gpt import RMSNorm
from tinyscale.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelRMSNorm,
    VocabParallelEmbedding,
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
    split_to_sequence,
    vocab_parallel_cross_entropy,
)
from tinyscale.testing import FLOAT64_ATOL, FLOAT64_RTOL, run_on_ranks

WORLD = dist.group.WORLD


def _randn(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _close(actual, expected, what, failures):
    if actual.shape != expected.shape or not torch.allclose(actual, expected, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL):
        diff = (actual - expected).abs().max().item() if actual.shape == expected.shape else "shape"
        failures.append(f"rank {dist.get_rank()} {what}: {tuple(actual.shape)} vs {tuple(expected.shape)}, {diff}")


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_(True)


def comm_ops_body():
    """Each op's forward and backward against what it is defined to do, from every rank's inputs."""
    n, r = dist.get_world_size(), dist.get_rank()
    B, T, X = 2, 6, 6  # T and X divide 2 and 3
    per_rank = lambda seed, *shape: [_randn(seed + 10 * i, *shape) for i in range(n)]  # noqa: E731
    fails: list[str] = []

    x = _leaf(_randn(1, B, T, X))  # f: replicated in, partial gradients out
    g = per_rank(2, B, T, X)
    y = copy_to_region(x, WORLD)
    _close(y, x.detach(), "copy_to_region forward", fails)
    y.backward(g[r])
    _close(x.grad, sum(g), "copy_to_region backward", fails)

    xs = per_rank(3, B, T, X)  # g: partial sums in, replicated out
    x = _leaf(xs[r])
    y = reduce_from_region(x, WORLD)
    _close(y, sum(xs), "reduce_from_region forward", fails)
    y.backward(_randn(4, B, T, X))
    _close(x.grad, _randn(4, B, T, X), "reduce_from_region backward", fails)

    x = _leaf(xs[r])  # hidden-dim gather / scatter
    y = gather_from_region(x, WORLD)
    _close(y, torch.cat(xs, dim=-1), "gather_from_region forward", fails)
    y.backward(_randn(5, B, T, n * X))
    _close(x.grad, _randn(5, B, T, n * X).chunk(n, -1)[r], "gather_from_region backward", fails)
    x = _leaf(_randn(6, B, T, X))
    y = scatter_to_region(x, WORLD)
    _close(y, x.detach().chunk(n, -1)[r], "scatter_to_region forward", fails)
    gs = per_rank(7, B, T, X // n)
    y.backward(gs[r])
    _close(x.grad, torch.cat(gs, -1), "scatter_to_region backward", fails)

    xs = per_rank(8, B, T // n, X)  # sequence parallelism: dim 1
    x = _leaf(xs[r])
    y = gather_from_sequence(x, WORLD)
    _close(y, torch.cat(xs, dim=1), "gather_from_sequence forward", fails)
    gs = per_rank(9, B, T, X)
    y.backward(gs[r])
    _close(x.grad, sum(gs).chunk(n, 1)[r], "gather_from_sequence backward", fails)
    xs = per_rank(11, B, T, X)
    x = _leaf(xs[r])
    y = reduce_scatter_to_sequence(x, WORLD)
    _close(y, sum(xs).chunk(n, 1)[r], "reduce_scatter_to_sequence forward", fails)
    gs = per_rank(12, B, T // n, X)
    y.backward(gs[r])
    _close(x.grad, torch.cat(gs, 1), "reduce_scatter_to_sequence backward", fails)
    x = _leaf(_randn(13, B, T, X))
    y = split_to_sequence(x, WORLD)
    _close(y, x.detach().chunk(n, 1)[r], "split_to_sequence forward", fails)
    y.backward(gs[r])
    _close(x.grad, torch.cat(gs, 1), "split_to_sequence backward", fails)

    try:  # a sequence that does not divide is refused, naming both numbers
        reduce_scatter_to_sequence(_randn(14, B, n * 2 + 1, X), WORLD)
        fails.append("T not divisible by tp was accepted")
    except ValueError as exc:
        if f"size {n * 2 + 1}" not in str(exc) or f"degree {n}" not in str(exc):
            fails.append(f"unclear error: {exc}")
    return fails


@pytest.mark.parametrize("world", [2, 3])
def test_tp_comm_ops_forward_backward_match_definitions(world):
    for fails in run_on_ranks(comm_ops_body, world):
        assert not fails, "\n".join(fails)


def _grads_full(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {n: layer.full_tensor(n, p.grad) if hasattr(layer, "full_tensor") else p.grad
            for n, p in layer.named_parameters()}


def column_row_body(gather_output: bool, bias: bool):
    """dense: lin2(gelu(lin1(x))); tensor-parallel: column lin1 then row lin2."""
    torch.manual_seed(0)
    C, Fh = 5, 12  # Fh divides 2, 3 and 4; C divides none of them (only the row output is C)
    lin1 = nn.Linear(C, Fh, bias=bias, dtype=torch.float64)
    lin2 = nn.Linear(Fh, C, bias=bias, dtype=torch.float64)
    x, w_out = _randn(1, 3, 4, C), _randn(2, 3, 4, C)
    xd = _leaf(x)
    ((lin2(F.gelu(lin1(xd)))) * w_out).sum().backward()

    col = ColumnParallelLinear.from_linear(lin1, WORLD, gather_output=gather_output)
    row = RowParallelLinear.from_linear(lin2, WORLD, input_is_parallel=not gather_output)
    xt = _leaf(x)
    y = row(F.gelu(col(xt)))
    (y * w_out).sum().backward()
    fails: list[str] = []
    _close(y.detach(), lin2(F.gelu(lin1(x))).detach(), "output", fails)
    _close(xt.grad, xd.grad, "input grad", fails)
    for layer, dense, name in ((col, lin1, "column"), (row, lin2, "row")):
        for key, grad in _grads_full(layer).items():
            _close(grad, getattr(dense, key).grad, f"{name} {key} grad", fails)
    return fails


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("gather_output", "bias"), [(False, False), (True, True)])
def test_tp_column_row_match_dense(world, gather_output, bias):
    for fails in run_on_ranks(column_row_body, world, gather_output, bias):
        assert not fails, "\n".join(fails)


def sequence_parallel_body():
    """dense: lin2(gelu(lin1(norm(x)))) on (B, T, C); SP: each rank its T/t tokens in and out."""
    n, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    C, Fh, T = 4, 6, 6
    norm = RMSNorm(C, 1e-5, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    lin1 = nn.Linear(C, Fh, bias=True, dtype=torch.float64)
    lin2 = nn.Linear(Fh, C, bias=True, dtype=torch.float64)
    x, w_out = _randn(1, 2, T, C), _randn(2, 2, T, C)
    xd = _leaf(x)
    yd = lin2(F.gelu(lin1(norm(xd))))
    (yd * w_out).sum().backward()

    sp_norm = SequenceParallelRMSNorm(RMSNorm(C, 1e-5, dtype=torch.float64), WORLD)
    with torch.no_grad():
        sp_norm.weight.copy_(norm.weight)
    col = ColumnParallelLinear.from_linear(lin1, WORLD, sequence_parallel=True)
    row = RowParallelLinear.from_linear(lin2, WORLD, sequence_parallel=True)
    xt = _leaf(x.chunk(n, 1)[r])  # (B, T/t, C)
    y = row(F.gelu(col(sp_norm(xt))))  # (B, T/t, C)
    (y * w_out.chunk(n, 1)[r]).sum().backward()
    fails: list[str] = []
    _close(y.detach(), yd.detach().chunk(n, 1)[r], "output shard", fails)
    _close(xt.grad, xd.grad.chunk(n, 1)[r], "input grad shard", fails)
    _close(sp_norm.weight.grad, norm.weight.grad, "norm weight grad (all-reduced)", fails)
    for layer, dense, name in ((col, lin1, "column"), (row, lin2, "row")):
        for key, grad in _grads_full(layer).items():
            _close(grad, getattr(dense, key).grad, f"{name} {key} grad", fails)
    return fails


@pytest.mark.parametrize("world", [2, 3])
def test_sp_sequence_parallel_norm_column_row_match_dense(world):
    for fails in run_on_ranks(sequence_parallel_body, world):
        assert not fails, "\n".join(fails)


def embedding_body(sequence_parallel: bool):
    n, r = dist.get_world_size(), dist.get_rank()
    V, C = 11, 3  # 11 divides none of 2, 3, 4: the last shard is padded
    torch.manual_seed(0)  # the same full layer on every rank
    dense = nn.Embedding(V, C, dtype=torch.float64)
    ids = torch.tensor([[0, 10, 5, 5, 3, 7, 10, 1, 2, 9, 4, 6], [8, 8, 10, 0, 1, 2, 3, 4, 5, 6, 7, 9]])  # (2, 12)
    w_out = _randn(1, 2, 12, C)
    (dense(ids) * w_out).sum().backward()
    emb = VocabParallelEmbedding.from_embedding(dense, WORLD, sequence_parallel=sequence_parallel)
    y = emb(ids)
    fails: list[str] = []
    expected, w_mine = dense(ids).detach(), w_out
    if sequence_parallel:
        expected, w_mine = expected.chunk(n, 1)[r], w_out.chunk(n, 1)[r]
    _close(y.detach(), expected, "embedding output", fails)
    (y * w_mine).sum().backward()
    _close(emb.full_tensor("weight", emb.weight.grad), dense.weight.grad, "embedding weight grad", fails)
    _close(emb.full_tensor("weight", emb.weight.detach()), dense.weight.detach(), "full weight", fails)
    first_padding = V - r * emb.local_rows  # local rows at or past it are padding: zero, no gradient
    if first_padding < emb.local_rows and emb.weight[max(first_padding, 0):].abs().sum() != 0:
        fails.append(f"rank {r}: padding rows are not zero")
    return fails


@pytest.mark.parametrize(("world", "sequence_parallel"), [
    pytest.param(w, sp, id=f"{w}-{'sequence_parallel' if sp else 'no_sp'}") for w, sp in [(2, True), (3, False), (4, False), (4, True)]])
def test_vocab_parallel_embedding_matches_dense(world, sequence_parallel):
    for fails in run_on_ranks(embedding_body, world, sequence_parallel):
        assert not fails, "\n".join(fails)


def cross_entropy_body():
    n, r = dist.get_world_size(), dist.get_rank()
    N, V = 7, 11
    local_cols = -(-V // n)  # ceil(V/t)
    logits, w_loss = _randn(1, N, V) * 3, _randn(2, N)
    targets = torch.tensor([0, 10, 4, 4, 9, 1, 10])
    ld = _leaf(logits)
    (F.cross_entropy(ld, targets, reduction="none") * w_loss).sum().backward()
    # Padding columns hold large junk: if they were not masked out they would dominate the loss.
    padded = torch.cat([logits, torch.full((N, local_cols * n - V), 50.0, dtype=torch.float64)], -1)
    local = _leaf(padded.chunk(n, -1)[r])  # (N, ceil(V/t))
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        loss = vocab_parallel_cross_entropy(local, targets, WORLD, vocab_size=V)
    (loss * w_loss).sum().backward()
    fails: list[str] = []
    _close(loss.detach(), F.cross_entropy(logits, targets, reduction="none"), "per-token loss", fails)
    expected_grad = torch.cat([ld.grad, torch.zeros(N, local_cols * n - V, dtype=torch.float64)], -1)
    _close(local.grad, expected_grad.chunk(n, -1)[r], "local logits grad", fails)
    if max(saved) > N * local_cols:  # the memory claim: at most ceil(V/t) logits per row per rank
        fails.append(f"rank {r}: saved a tensor of {max(saved)} elements > N*ceil(V/t) = {N * local_cols}")
    return fails


@pytest.mark.parametrize("world", [2, 3, 4])
def test_vocab_parallel_cross_entropy_matches_dense(world):
    for fails in run_on_ranks(cross_entropy_body, world):
        assert not fails, "\n".join(fails)


def reject_body():
    out = []
    for build in (lambda: ColumnParallelLinear(4, 7, WORLD), lambda: RowParallelLinear(7, 4, WORLD),
                  lambda: ColumnParallelLinear(4, 7, WORLD, pad_out_features=True, gather_output=True)):
        try:
            build()
            out.append("accepted")
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_tp_layers_reject_indivisible_sizes():
    column, row, gathered = run_on_ranks(reject_body, 2)[0]
    assert "out_features=7" in column and "degree 2" in column
    assert "in_features=7" in row and "degree 2" in row
    assert "gather_output" in gathered and "out_features=7" in gathered
