"""Adaptive learning rates beside a fixed schedule (OPT-16; lesson 02, "Adaptive schedules";
`pytest -k lr_adaptive`).

One noisy least-squares problem (SGD on minibatches of 8 rows) trained 150 steps four ways:
warm-up + cosine (`lr_at`), ReduceLROnPlateau on a smoothed loss, the "x1.1 while the loss
falls" rule, and a constant lr. `ADAPTIVE_TABLE` is lesson 02's table, computed here. Then on
2 ranks: ReduceLROnPlateau fed the mean loss over the ranks takes the same decisions on every
rank; fed each rank's own loss, the ranks' learning rates part.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import torch
import torch.distributed as dist

from tinyscale.config import EngineConfig
from tinyscale.optim import lr_at
from tinyscale.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
STEPS, LR, ROWS, DIM = 150, 0.05, 8, 10


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, DIM, generator=g, dtype=torch.float64)
    w_true = torch.randn(DIM, generator=g, dtype=torch.float64)
    y = x @ w_true + 0.1 * torch.randn(512, generator=g, dtype=torch.float64)
    return x, y


def _loss(w, x, y):
    return ((x @ w - y) ** 2).mean()


def _train(rule: str, rank: int = 0, world: int = 1, mean_loss: bool = True):
    """(full-data loss after each step, lr of each step)."""
    x, y = _problem()
    w = torch.zeros(DIM, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([w], lr=LR)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=5) if rule == "plateau" else None
    cosine = EngineConfig.load({"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": LR}},
                                "scheduler": {"type": "WarmupCosineLR", "params": {
                                    "warmup_num_steps": 10, "total_num_steps": STEPS}}})
    gen = torch.Generator().manual_seed(1 + rank)
    smooth, previous, losses, lrs = None, math.inf, [], []
    for step in range(STEPS):
        if rule == "cosine":
            opt.param_groups[0]["lr"] = lr_at(step, cosine)
        rows = torch.randint(0, len(x), (ROWS,), generator=gen)
        loss = _loss(w, x[rows], y[rows])
        opt.zero_grad()
        loss.backward()
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        seen = loss.detach().clone()
        if world > 1 and mean_loss:  # every rank decides on the same number
            dist.all_reduce(seen)
            seen /= world
        smooth = seen.item() if smooth is None else 0.9 * smooth + 0.1 * seen.item()  # a smoothed loss
        if plateau is not None:
            plateau.step(smooth)
        if rule == "x1.1" and seen.item() < previous:  # raise the lr while the loss falls
            opt.param_groups[0]["lr"] *= 1.1
        previous = seen.item()
        with torch.no_grad():
            losses.append(_loss(w, x, y).item())
    return losses, lrs


@cache
def adaptive_rows() -> list[tuple[str, float, float, float]]:
    """(rule, loss at step 50, final loss, largest lr used)."""
    rows = []
    for rule in ("cosine", "plateau", "x1.1", "constant"):
        losses, lrs = _train(rule)
        rows.append((rule, losses[49], losses[-1], max(lrs)))
    return rows


def lesson_row(rule, at50, final, top) -> str:
    return f"| {rule} | {at50:.3g} | {final:.3g} | {top:.3g} |"


def test_lr_adaptive_x1_1_rule_diverges_where_cosine_and_plateau_converge():
    rows = {rule: (at50, final, top) for rule, at50, final, top in adaptive_rows()}
    start = _loss(torch.zeros(DIM, dtype=torch.float64), *_problem()).item()
    assert rows["cosine"][1] < start / 100 and rows["plateau"][1] < start / 100
    assert not math.isfinite(rows["x1.1"][1]) or rows["x1.1"][1] > start * 1e3  # diverged
    text = (ROOT / "lessons/02-data-parallel.md").read_text()
    for row in adaptive_rows():
        assert lesson_row(*row) in text, f"lesson 02 lacks the row\n{lesson_row(*row)}"


def _plateau_on_ranks():
    world, rank = dist.get_world_size(), dist.get_rank()
    return _train("plateau", rank, world, True)[1], _train("plateau", rank, world, False)[1]


def test_lr_adaptive_plateau_decisions_agree_on_every_rank_only_on_the_mean_loss():
    (mean0, own0), (mean1, own1) = run_on_ranks(_plateau_on_ranks, 2)
    assert mean0 == mean1 and min(mean0) < LR  # the same reductions, at the same steps
    assert own0 != own1  # each rank's own noisy loss: the ranks' lrs part
