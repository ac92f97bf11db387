"""Lessons and docs hold no control characters: a "\\frac" written through a Python string
without r"" becomes a form feed + "rac", which the browser test only catches as raw math
on one page, after a full site build. And statements that were once true and are not now stay
out (`STALE`). Run: `pytest -k docs_text`."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # all but tab, newline, carriage return


def test_docs_text_has_no_control_characters():
    found = []
    for path in sorted([*ROOT.glob("lessons/*.md"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]):
        for number, line in enumerate(path.read_text().split("\n"), 1):  # not splitlines(): it splits at \f
            if CONTROL.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:80]!r}")
    assert not found, "control characters (a lost backslash, e.g. \\f of \\frac?):\n" + "\n".join(found)


# Statements that were true once and are not now (issue 31): each stays out of the lessons.
STALE = {
    "rank 0 holds and writes the whole state": "every rank builds the checkpoint's state; rank 0 writes it",
    "needs a conversion step (\"universal checkpointing\") to change the data-parallel degree":
        "DeepSpeed's ZeRO 1/2 elastic_checkpoint changed the dp degree without one",
    'tinyscale refuses `"auto"` by field name': "train_batch_size \"auto\" is derived (config_deepspeed.py)",
}


def test_docs_text_has_no_stale_statements():
    found = []
    for path in sorted([*ROOT.glob("lessons/*.md"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]):
        text = " ".join(path.read_text().split())  # a phrase may wrap across lines
        found += [f"{path.relative_to(ROOT)}: {phrase!r} ({why})" for phrase, why in STALE.items() if phrase in text]
    assert not found, "stale statements:\n" + "\n".join(found)
