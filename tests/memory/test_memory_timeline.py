"""A training step's memory by category on the CPU (DS-25; lesson 06, "Memory through a
step, by category"; `pytest -k memory_timeline`).

Steady-state step of a small GPT with AdamW (float32): gradients come to exactly the
parameters' bytes and are gone after zero_grad, AdamW's states are two copies of the
parameters (plus its step counters), activations are held from the forward until the backward
has used them. `TABLE` is lesson 06's table, computed here.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from tinyscale.data import synthetic_token_batches
from tinyscale.memory.timeline import CATEGORIES, memory_timeline
from tinyscale.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("forward", "backward", "optimizer", "zero_grad")


@cache
def _steady_step():
    cfg = GPTConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=2, d_model=32, ffn_hidden=64)
    model = GPT(cfg, seed=0, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    (x, y), = synthetic_token_batches(num_batches=1, batch_size=4, seq_len=16, vocab_size=64, seed=0)

    def forward():
        return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    memory_timeline(model, opt, forward)  # the first step creates AdamW's states
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return memory_timeline(model, opt, forward), params, len(list(model.parameters()))


def lesson_rows() -> list[str]:
    timeline = _steady_step()[0]
    rows = [(f"end of {p}", timeline.at_end_of(p)) for p in PHASES] + [("peak", timeline.peaks)]
    return [f"| {name} | " + " | ".join(f"{r[c]:,}" for c in CATEGORIES) + " |" for name, r in rows]


def test_memory_timeline_categories_are_the_step_s_states():
    timeline, params, count = _steady_step()
    ends = {p: timeline.at_end_of(p) for p in PHASES}
    assert all(r["parameters"] == params for _, r in timeline.rows)
    assert ends["backward"]["gradients"] == params and ends["zero_grad"]["gradients"] == 0
    # AdamW: exp_avg and exp_avg_sq per parameter, and one float32 step counter each
    assert ends["optimizer"]["optimizer"] == 2 * params + 4 * count
    assert ends["forward"]["activations"] > params and ends["backward"]["activations"] == 0
    assert timeline.peaks["activations"] == ends["forward"]["activations"]  # held until the backward
    assert ends["zero_grad"]["temporaries"] == 0


def test_memory_timeline_lesson_table_is_the_measured_one():
    text = (ROOT / "lessons/06-mfu.md").read_text()
    for row in lesson_rows():
        assert row in text, f"lesson 06 lacks the row\n{row}"
