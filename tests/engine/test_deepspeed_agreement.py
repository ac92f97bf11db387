"""tinyscale against DeepSpeed 0.19.8 itself: the same config, the same numbers.

DeepSpeed runs in a process of its own (`tinyscale.testing.deepspeed_peer`), so importing it
never touches this one. Each test sends DeepSpeed the whole batch of cases at once (one process
start) and compares every value.

    pytest -k deepspeed_agreement            # needs the `peers` extra: pip install -e ".[peers]"
"""

from __future__ import annotations

import itertools

import pytest

from tinyscale.config import EngineConfig
from tinyscale.optim import lr_at
from tinyscale.testing import deepspeed_peer

pytestmark = pytest.mark.skipif(not deepspeed_peer.available(),
                                reason="DeepSpeed is not installed: pip install -e '.[peers]' (make setup does)")


# --- learning-rate schedulers -------------------------------------------------------------------

def _schedule_cases() -> list[dict]:
    """Every scheduler type x warm-up shape x warm-up length (1 and 2 are the clamp's edge,
    None is the default 1000) x the type's own keys (given or left to their defaults) x two
    optimizer lrs: 320 parameter sets, each run 60 steps past its end."""
    cases = []
    for kind, warmup_type, warmup, lr in itertools.product(
            ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"), ("log", "linear"), (None, 1, 2, 37), (3e-4, 0.1)):
        base = {"warmup_type": warmup_type} | ({} if warmup is None else {"warmup_num_steps": warmup})
        w = warmup or 1000
        if kind == "WarmupCosineLR":
            own = [{}, {"warmup_min_ratio": 0.1}, {"cos_min_ratio": 0.2}, {"warmup_min_ratio": 0.3, "cos_min_ratio": 0}]
        else:
            own = [{}, {"warmup_min_lr": 1e-5}, {"warmup_max_lr": 5e-3}, {"warmup_min_lr": 2e-4, "warmup_max_lr": 2e-4}]
        totals = [None] if kind == "WarmupLR" else [w, 2 * w + 11]
        for params, total in itertools.product(own, totals):
            extra = {} if total is None else {"total_num_steps": total}
            cases.append({"type": kind, "lr": lr, "params": base | params | extra, "steps": (total or w) + 60})
    return cases


def _tinyscale_lrs(case: dict) -> list[float]:
    cfg = EngineConfig.load({"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": case["lr"]}},
                             "scheduler": {"type": case["type"], "params": case["params"]}})
    return [lr_at(step, cfg) for step in range(case["steps"])]


def test_deepspeed_agreement_schedulers_give_deepspeeds_lr_at_every_step():
    cases = _schedule_cases()
    theirs = deepspeed_peer.run("schedules", cases)
    differ = []
    for case, ds in zip(cases, theirs):
        ours = _tinyscale_lrs(case)
        # equal, not close: lr_at does DeepSpeed's arithmetic in DeepSpeed's order
        bad = [step for step, (a, b) in enumerate(zip(ours, ds)) if a != b]
        if bad:
            differ.append(f"{case['type']} lr {case['lr']} {case['params']}: first at step {bad[0]}, "
                          f"tinyscale {ours[bad[0]]!r} DeepSpeed {ds[bad[0]]!r}")
    assert len(cases) == 320 and not differ, f"{len(differ)} of {len(cases)} differ:\n" + "\n".join(differ[:10])
