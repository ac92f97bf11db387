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


def _lever(lever: str):
    """(the step's bytes at the end of the forward and at the peak, by category; the loss's
    gradient) for one micro-batch of a steady-state step with one lever applied."""
    from tinyscale.checkpointing import apply_policy

    cfg = GPTConfig(vocab_size=64, max_seq_len=32, n_layer=2, n_head=2, d_model=32, ffn_hidden=64)
    model = GPT(cfg, seed=0, dtype=torch.float64)
    if lever == "checkpointing":
        apply_policy(model, "full")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    (x, y), = synthetic_token_batches(num_batches=1, batch_size=8, seq_len=32, vocab_size=64, seed=0)
    rows = 4 if lever == "accumulation" else 8  # two micro-batches of 4 rows make the same global batch

    def forward():
        return torch.nn.functional.cross_entropy(model(x[:rows]).flatten(0, 1), y[:rows].flatten()) * rows / 8
    memory_timeline(model, opt, forward)
    timeline = memory_timeline(model, opt, forward)
    return timeline.at_end_of("forward"), timeline.peaks


def test_memory_timeline_each_lever_cuts_its_own_term():
    """DS-38's claim, measured: accumulation (half the rows per micro-batch) and checkpointing
    cut the activations; neither touches the parameters, gradients or optimizer states (what
    ZeRO and offload cut: lesson 03's stacking table)."""
    base_end, base_peak = _lever("none")
    measured = {}
    for lever in ("accumulation", "checkpointing"):
        end, peak = _lever(lever)
        assert end["activations"] < 0.6 * base_end["activations"], lever
        assert all(peak[c] == base_peak[c] for c in ("parameters", "gradients", "optimizer")), lever
        measured[lever] = (end["activations"], peak["temporaries"])
    # half the rows, half the activations, but for the scalars every micro-batch saves (8 bytes here)
    assert abs(2 * measured["accumulation"][0] - base_end["activations"]) <= 16
    # the recomputation brings a block's activations back inside the backward, as temporaries
    assert measured["checkpointing"][1] > base_peak["temporaries"]
    text = " ".join((ROOT / "lessons/03-zero.md").read_text().split())
    claim = (f"activations at the end of the forward go from {base_end['activations']:,} bytes to "
             f"{measured['accumulation'][0]:,} with accumulation and to {measured['checkpointing'][0]:,} with "
             f"checkpointing, whose recomputation raises the peak of temporaries in the backward from "
             f"{base_peak['temporaries']:,} to {measured['checkpointing'][1]:,}")
    assert claim in text, f"lesson 03 lacks: {claim}"
