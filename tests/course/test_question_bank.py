"""The question bank: every source question is in the data file, the site's page is generated
from it, and every lesson section and proof it names exists (issue 16).

    pytest -k question_bank
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from tinyscale.course import bank

ROOT = Path(__file__).resolve().parents[2]
# The source collections: DS-1..40, DT-1..9, OPT-1..20, BASIC-1..15 (84 questions).
SOURCE_IDS = {f"{p}-{i}" for p, n in (("DS", 40), ("DT", 9), ("OPT", 20), ("BASIC", 15)) for i in range(1, n + 1)}
QUESTIONS_MD = ROOT.parent / "shared" / "QUESTIONS.md"  # the index, where this checkout sits beside it


@pytest.fixture(scope="module")
def questions() -> list[bank.Question]:
    return bank.load()


@pytest.fixture(scope="module")
def headings() -> dict:
    pytest.importorskip("mkdocs", reason="the site's Markdown extensions: pip install -e '.[docs]'")
    return bank.lesson_headings(ROOT)


def test_question_bank_holds_every_source_question_once(questions):
    ids = [q.id for q in questions]
    assert len(ids) == len(set(ids)) == 84
    assert set(ids) == SOURCE_IDS
    if QUESTIONS_MD.exists():
        assert set(ids) == set(re.findall(r"^- ((?:DS|DT|OPT|BASIC)-\d+) \|", QUESTIONS_MD.read_text(), re.M))


def test_question_bank_header_names_no_file_outside_the_repository():
    """The data file stands alone: its header says where the questions come from in words, and
    names no absolute path (a checkout elsewhere has no such file)."""
    header = "".join(line for line in (ROOT / "src/tinyscale/course/questions.yaml").read_text().splitlines(True)
                     if line.startswith("#"))
    assert not re.search(r"(^|\s)/\w", header), "questions.yaml's header names an absolute path"
    assert "shared/" not in header and "84" in header


def test_question_bank_page_is_generated_from_the_data(questions, headings):
    page = (ROOT / "docs/questions.md").read_text()
    assert page == bank.render(questions, headings), \
        "docs/questions.md is out of date: edit src/tinyscale/course/questions.yaml (not the page), " \
        "then run python -m tinyscale.course.bank --write"


def test_question_bank_sections_are_headings_of_the_lessons(questions, headings):
    missing = [f"{q.id}: {s}" for q in questions for s in q.sections
               if s.split("#")[1] not in headings.get(s.split("#")[0], ("", {}))[1]]
    assert missing == []


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("test")}


def test_question_bank_proofs_exist(questions):
    missing = []
    for q in questions:
        for proof in q.proof:
            if proof.startswith("tests/"):
                file, name = proof.split("::")
                if not (ROOT / file).is_file() or name not in _test_functions(ROOT / file):
                    missing.append(f"{q.id}: {proof}")
            else:
                file, cell = proof.split("#")
                cells = json.loads((ROOT / file).read_text())["cells"] if (ROOT / file).is_file() else []
                if not any(c.get("id") == cell and c["cell_type"] == "code" for c in cells):
                    missing.append(f"{q.id}: {proof}")
    assert missing == []


def test_question_bank_groups_each_question_under_a_lesson_that_answers_it(questions):
    # The page lists questions "grouped by the lesson that answers it": the group is the lesson
    # of one of its sections, or the lesson planned to answer it (DS-33 sat under 12-engine
    # while only lesson 03 answered it).
    def answering(q: bank.Question) -> set[str]:
        return {s.split("#")[0].removeprefix("lessons/").removesuffix(".md") for s in q.sections} | {q.planned}

    assert [(q.id, q.group) for q in questions if q.group not in answering(q)] == []


def test_question_bank_answered_questions_have_a_proof_and_planned_lessons_are_unwritten(questions):
    assert [q.id for q in questions if q.sections and not q.proof] == []
    # A question's planned part waits for a lesson that does not exist yet, or, for a lesson
    # written in parts (12-engine), for a part that the lesson's introduction names as planned.
    def waits_openly(q: bank.Question) -> bool:
        intro = (ROOT / f"lessons/{q.planned}.md").read_text().split("\n## The questions", 1)[0]
        return "planned" in intro and re.search(rf"\b{re.escape(q.id)}\b", intro) is not None

    # Answered or not: a `planned` lesson that exists must say so, or the entry is stale (DS-16
    # named lesson 08 as planned long after it was written).
    assert [q.id for q in questions if q.planned and (ROOT / f"lessons/{q.planned}.md").exists()
            and not waits_openly(q)] == []


def test_question_bank_bad_entries_name_the_field():
    good = {"id": "DS-1", "tag": "t", "group": "12-engine", "question": "q", "answer": "a", "planned": "12-engine"}
    assert bank.parse([good])[0].id == "DS-1"
    for change, words in [({"sections": ["lessons/zero.md"]}, "section 'lessons/zero.md'"),
                          ({"proof": ["test_x"]}, "proof 'test_x'"),
                          ({"planned": None}, "needs `sections`"),
                          ({"answer": ""}, "`answer`"),
                          ({"group": "99-x"}, "group '99-x'"),
                          ({"answr": "a"}, "unknown field")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            bank.parse([{**good, **change}])
    with pytest.raises(ValueError, match="appear once"):
        bank.parse([good, good])
