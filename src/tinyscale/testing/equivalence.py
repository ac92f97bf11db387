"""Helpers for the central claim of every topic: it trains exactly like one process.

Equivalence tests run in float64. There, summing the same numbers in a different order
(what splitting a batch over ranks does) changes a result by ~1e-16 relative, and a
few optimizer steps keep it near 1e-15; a real bug (a missing 1/N, a micro-batch counted
twice, a stale gradient) shows at 1e-6 or more. So the tolerances below are tight enough
to catch every bug of that kind and loose enough never to trip on reduction order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

# --8<-- [start:float64-tolerances]
# Relative tolerance for float64 equivalence (DESIGN.md). Reduction-order noise is ~1e-15.
FLOAT64_RTOL = 1e-10
# Absolute floor for values that are ~0 (parameters are O(0.01-1), so relative error is
# meaningless near 0): 1e-12 is ~1000x the noise and ~1e6x below the smallest real bug.
FLOAT64_ATOL = 1e-12
# --8<-- [end:float64-tolerances]


def state_dict_cpu(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of a model's state_dict (safe to send between processes)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def max_abs_diff(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> float:
    """Largest elementwise |actual - expected| over all shared keys (in float64)."""
    worst = 0.0
    for key in expected:
        a, e = actual[key].double().cpu(), expected[key].double().cpu()
        if a.numel():
            worst = max(worst, (a - e).abs().max().item())
    return worst


def assert_state_dicts_close(
    actual: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    *,
    rtol: float = FLOAT64_RTOL,
    atol: float = FLOAT64_ATOL,
    what: str = "state",
) -> None:
    """Same keys, same shapes, values close; the message names the worst tensor."""
    missing, extra = set(expected) - set(actual), set(actual) - set(expected)
    if missing or extra:
        raise AssertionError(f"{what}: keys differ; missing {sorted(missing)}, unexpected {sorted(extra)}")
    failures = []
    for key in expected:
        a, e = actual[key].detach().cpu(), expected[key].detach().cpu()
        if a.shape != e.shape:
            failures.append(f"{key}: shape {tuple(a.shape)} != expected {tuple(e.shape)}")
            continue
        if a.dtype != e.dtype:
            failures.append(f"{key}: dtype {a.dtype} != expected {e.dtype}")
            continue
        if not torch.allclose(a, e, rtol=rtol, atol=atol, equal_nan=True):
            diff = (a.double() - e.double()).abs()
            rel = diff / e.double().abs().clamp_min(atol)
            failures.append(f"{key}: max |diff| {diff.max().item():.3e}, max rel {rel.max().item():.3e}")
    if failures:
        raise AssertionError(f"{what} differ (rtol={rtol:g}, atol={atol:g}):\n  " + "\n  ".join(failures))


def assert_losses_close(
    actual: Sequence[float], expected: Sequence[float], *, rtol: float = FLOAT64_RTOL, atol: float = FLOAT64_ATOL
) -> None:
    """Per-step losses agree; the message names the first step that does not."""
    if len(actual) != len(expected):
        raise AssertionError(f"{len(actual)} losses, expected {len(expected)}")
    for step, (a, e) in enumerate(zip(actual, expected)):
        if not abs(a - e) <= atol + rtol * abs(e):
            raise AssertionError(f"loss at step {step}: {a!r} != expected {e!r} (|diff| {abs(a - e):.3e})")


def assert_every_rank_trained_like(per_rank: Sequence[tuple], expected_losses: Sequence[float],
                                   expected: dict[str, torch.Tensor], *, what: str) -> None:
    """Each rank's (losses, full_state_dict, ...) equals the single process's losses and state,
    under the original keys in their order (the engine's equivalence check, every rank alike)."""
    for rank, (losses, state, *_) in enumerate(per_rank):
        assert_losses_close(losses, expected_losses)
        if list(state) != list(expected):
            raise AssertionError(f"{what}, rank {rank}: keys {list(state)} differ from the model's {list(expected)}")
        assert_state_dicts_close(state, expected, what=f"{what}, rank {rank}")


def vocab_shard_boundary_ids(vocab_size: int, degrees: tuple[int, ...]) -> list[int]:
    """The token ids on either side of every vocab-shard boundary at each TP degree (a shard
    holds ceil(V / t) rows), and the first and last ids: sorted, each once."""
    ids = {0, vocab_size - 1}
    for t in degrees:
        rows = -(-vocab_size // t)
        for r in range(1, t):
            ids |= {i for i in (r * rows - 1, r * rows) if i < vocab_size}
    return sorted(ids)


def with_vocab_boundary_ids(batches: list, vocab_size: int, degrees: tuple[int, ...]) -> list:
    """`batches` [(inputs, targets)] with the first row's leading inputs and targets replaced by
    `vocab_shard_boundary_ids`, so that an end-to-end test looks up and scores every id a
    sharded table splits at (random ids hit a boundary only by chance)."""
    ids = torch.tensor(vocab_shard_boundary_ids(vocab_size, degrees))
    out = []
    for k, (inputs, targets) in enumerate(batches):
        inputs, targets = inputs.clone(), targets.clone()
        n = min(len(ids), inputs.shape[1])
        inputs[0, :n] = ids.roll(k)[:n]  # a different id at each position from batch to batch
        targets[0, :n] = ids.roll(k + 1)[:n]
        out.append((inputs, targets))
    return out
