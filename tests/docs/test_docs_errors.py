"""The lessons' error examples are what the code raises (`pytest -k docs_claims`).

A lesson shows an error as a fenced block right after a marker `<!-- raised-by: NAME -->`;
`RAISED[NAME]` runs the code that raises it, and the block must be its message, line for line
(indentation aside). Every marker has an entry and every entry a marker, so an example cannot
outlive the behaviour it shows. The values a lesson states beside them are computed here too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tinyscale.config import ConfigError, EngineConfig

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!-- raised-by: ([\w-]+) -->\s*\n\s*```text\n(.*?)\n\s*```", re.S)


def _message(config: dict) -> str:
    with pytest.raises(ConfigError) as info:
        EngineConfig.load(config)
    return str(info.value)


RAISED = {  # marker name -> the code that raises the lesson's error
    "lr-auto": lambda: _message({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}),
}


def _examples() -> dict[str, list[tuple[str, str]]]:
    found: dict[str, list[tuple[str, str]]] = {}
    for path in sorted(ROOT.glob("lessons/*.md")):
        for name, block in MARKER.findall(path.read_text()):
            found.setdefault(name, []).append((path.name, block))
    return found


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().splitlines()]


def test_docs_claims_error_examples_are_what_the_code_raises():
    examples = _examples()
    assert sorted(examples) == sorted(RAISED), "a marker without an entry in RAISED, or the reverse"
    for name, shown in examples.items():
        actual = _lines(RAISED[name]())
        for lesson, block in shown:
            assert _lines(block) == actual, f"{lesson}: the example '{name}' is not what the code raises:\n" + \
                "\n".join(actual)


def test_docs_claims_lesson_00_auto_batch_is_derived():
    """Lesson 00: train_batch_size "auto" with micro-batch 4 and accumulation 2 on 2 ranks is 16."""
    config = EngineConfig.load({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                                "gradient_accumulation_steps": 2})
    assert config.batch(2).train_batch_size == 16
    assert "is derived as 16 (micro × accumulation × dp)" in " ".join((ROOT / "lessons/00-setup.md").read_text().split())
