"""Figures the lessons quote that today's code computes cheaply, recomputed (`pytest -k docs_claims`).

Each test reads the figure from the lesson's own sentence and computes it again, so a lesson
that falls behind the code (or a code change that moves a quoted number) fails here. Timings
are not pinned: only counts, bytes and formulas.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tinyscale.data_parallel.bucketed import assign_buckets
from tinyscale.mfu.flops import attention_share, matmul_params
from tinyscale.models import GPT
from tinyscale.models.config import PRESETS

ROOT = Path(__file__).resolve().parents[2]


def _text(path: str) -> str:
    return " ".join((ROOT / path).read_text().split())  # a sentence may wrap across lines


def _number(s: str) -> float:
    return float(s.replace(",", ""))


def test_docs_claims_lesson_06_attention_shares_are_the_flop_counts():
    """Llama-3.2-1B's attention share at four lengths, and 6N's share at 131,072 tokens."""
    llama = PRESETS["llama-1b"]
    found = re.search(r"For Llama-3.2-1B's shapes: ([\d.]+) % at 2,048 tokens, (\d+) % at 8,192, "
                      r"(\d+) % at 32,768, (\d+) % at 131,072", _text("lessons/06-mfu.md"))
    assert found, "lesson 06 lost its sentence of attention shares"
    shown = [_number(x) for x in found.groups()]
    computed = [100 * attention_share(llama, t) for t in (2048, 8192, 32768, 131072)]
    assert shown == [round(computed[0], 1), *(round(c) for c in computed[1:])], computed
    # Exercise 2: the length where attention equals 6N (matmul N), and 6N's share at 131,072.
    crossing = matmul_params(llama) / (2 * llama.n_layer * llama.d_model)
    assert f"= {round(crossing):,} tokens" in _text("lessons/06-mfu.md")
    six_n = 1 - attention_share(llama, 131072)
    assert "at 131,072 tokens it counts an eighth" in _text("lessons/06-mfu.md")
    assert round(1 / six_n) == 8 and f"({100 * six_n:.1f} %" in _text("lessons/06-mfu.md"), six_n


def test_docs_claims_lesson_00_demo_buckets_and_calls_are_the_codes():
    """`make demo`'s small GPT in float64 with the ddp preset's 131,072-element buckets: the
    bucket count, the calls per step (one more: the loss) and the parameter count."""
    text = _text("lessons/00-setup.md")
    found = re.search(r"\(([\d,]+) × 8 bytes, in (\d+) buckets of at most ([\d,]+) elements\).*?"
                      r"(\d+) usage flags.*?: (\d+) calls per step", text)
    assert found, "lesson 00 lost its demo's all-reduce row"
    params, buckets, cap, flags, calls = (int(_number(x)) for x in found.groups())
    model = GPT(PRESETS["small"], dtype=torch.float64)
    tensors = list(model.parameters())
    assert params == sum(p.numel() for p in tensors)
    assert flags == len(tensors)
    assert buckets == len(assign_buckets(tensors, cap * 8))
    assert calls == buckets + 1
