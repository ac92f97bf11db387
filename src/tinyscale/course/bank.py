"""The question bank: one data file (`questions.yaml`) read by the quiz and rendered into the
site's `docs/questions.md`.

    python -m tinyscale.course.bank --write    # regenerate docs/questions.md after editing the data
    python -m tinyscale.course.bank --check    # exit 1 if docs/questions.md is out of date

Rendering needs the lessons' heading anchors and titles, computed by the same Markdown
extensions the site uses (mkdocs.yml's `markdown_extensions`), so it runs from a checkout with
the `docs` extra installed. Loading the data (`load()`) needs only PyYAML.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

ID = re.compile(r"(?:DS|DT|OPT|BASIC)-\d+")
TEST = re.compile(r"tests/[\w/]+\.py::\w+")
NOTEBOOK = re.compile(r"notebooks/[\w-]+\.ipynb#[\w-]+")
SECTION = re.compile(r"lessons/\d\d-[\w-]+\.md#[\w-]+")

# The bank's sections in order: a lesson's file stem (built or planned) and its title.
GROUPS = {
    "01-collectives": "01. Collectives",
    "02-data-parallel": "02. Data parallelism",
    "03-zero": "03. ZeRO and memory",
    "04-mixed-precision": "04. Mixed precision",
    "05-activation-checkpointing": "05. Activation checkpointing",
    "06-mfu": "06. MFU and profiling",
    "07-tensor-parallel": "07. Tensor parallelism",
    "08-pipeline-parallel": "08. Pipeline parallelism",
    "09-context-parallel": "09. Context parallelism",
    "10-compression": "10. Gradient compression",
    "11-kernels": "11. Kernels",
    "12-engine": "12. The engine",
    "13-moe": "13. Mixture of experts and expert parallelism",
}
FIELDS = {"id", "tag", "group", "question", "answer", "sections", "planned", "note", "proof"}


@dataclass(frozen=True)
class Question:
    id: str
    tag: str
    group: str
    question: str
    answer: str
    sections: tuple[str, ...] = ()
    planned: str | None = None
    note: str | None = None
    proof: tuple[str, ...] = field(default=())


def _bad(where: str, what: str) -> ValueError:
    return ValueError(f"questions.yaml, {where}: {what}")


def parse(entries: object) -> list[Question]:
    """Validate the data file's entries (a list of mappings) and return them as Questions."""
    if not isinstance(entries, list):
        raise _bad("top level", "must be a list of questions")
    out, seen = [], set()
    for n, e in enumerate(entries):
        where = f"entry {n} ({e.get('id', '?') if isinstance(e, dict) else '?'})"
        if not isinstance(e, dict):
            raise _bad(where, "must be a mapping with id, tag, group, question, answer")
        unknown = set(e) - FIELDS
        if unknown:
            raise _bad(where, f"unknown field(s) {sorted(unknown)}: use only {sorted(FIELDS)}")
        for key in ("id", "tag", "group", "question", "answer"):
            if not isinstance(e.get(key), str) or not e[key].strip():
                raise _bad(where, f"`{key}` must be a non-empty string")
        if not ID.fullmatch(e["id"]) or e["id"] in seen:
            raise _bad(where, f"id {e['id']!r} must look like DS-12 and appear once")
        seen.add(e["id"])
        if e["group"] not in GROUPS:
            raise _bad(where, f"group {e['group']!r} is not one of {', '.join(GROUPS)}")
        sections, proof = tuple(e.get("sections") or ()), tuple(e.get("proof") or ())
        for s in sections:
            if not SECTION.fullmatch(s):
                raise _bad(where, f"section {s!r} must look like lessons/03-zero.md#heading-anchor")
        for p in proof:
            if not (TEST.fullmatch(p) or NOTEBOOK.fullmatch(p)):
                raise _bad(where, f"proof {p!r} must be tests/...py::test_name or notebooks/NN.ipynb#cell-id")
        planned = e.get("planned")
        if not sections and not planned:
            raise _bad(where, "needs `sections` (the lesson that answers it) or `planned: NN-topic`")
        if planned is not None and planned not in GROUPS:
            raise _bad(where, f"planned {planned!r} is not one of {', '.join(GROUPS)}")
        out.append(Question(e["id"], e["tag"], e["group"], " ".join(e["question"].split()),
                            " ".join(e["answer"].split()), sections, planned, e.get("note"), proof))
    return out


def load() -> list[Question]:
    """The question bank, from the package's questions.yaml."""
    text = resources.files("tinyscale.course").joinpath("questions.yaml").read_text()
    return parse(yaml.safe_load(text))


# --- rendering docs/questions.md -----------------------------------------------------------

def lesson_headings(root: Path) -> dict[str, tuple[str, dict[str, str]]]:
    """Lesson file -> (its title, {anchor: heading text}), with the ids MkDocs will give the
    headings: the same Markdown extensions and settings as the site (mkdocs.yml)."""
    import markdown
    from mkdocs.config import load_config

    config = load_config(str(root / "mkdocs.yml"))
    out = {}
    for path in sorted((root / "lessons").glob("[0-9][0-9]-*.md")):
        md = markdown.Markdown(extensions=config["markdown_extensions"], extension_configs=config["mdx_configs"])
        md.convert(path.read_text())
        anchors: dict[str, str] = {}

        def walk(tokens: list[dict]) -> None:
            for t in tokens:
                anchors[t["id"]] = t["name"]
                walk(t["children"])

        walk(md.toc_tokens)
        title = md.toc_tokens[0]["name"] if md.toc_tokens else path.stem
        out[f"lessons/{path.name}"] = (title, anchors)
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _lesson_cell(q: Question, headings: dict) -> str:
    links = []
    for s in q.sections:
        page, anchor = s.split("#")
        name = headings[page][1].get(anchor, anchor)
        links.append(f"[{page[8:10]} · {_cell(name)}]({s})")
    if not links:
        return f"planned: {q.planned}"
    cell = ", ".join(links)
    if q.planned:
        cell += f" ({q.note + ': ' if q.note else 'the rest: '}lesson {q.planned}, planned)"
    return cell


def _proof_cell(q: Question) -> str:
    parts = []
    for p in q.proof:
        if p.startswith("notebooks/"):
            nb, cell = p.split("#")
            parts.append(f"`{nb}` cell `{cell}`")
        else:
            parts.append(f"`{p}`")
    return "<br>".join(parts) if parts else "not yet"


INTRO = """# Question bank

The {n} interview questions tinyscale is built to answer, each in one line, grouped by
the lesson that answers it and, inside a lesson, by topic tag. The ids follow the source
collections: **DS** (DeepSpeed), **DT** (distributed training in depth), **OPT**
(optimisation strategies) and **BASIC** (fundamentals).

Each row links the lesson section that answers the question and names its **proof**: the
test (run it with `pytest` and the node id) or notebook cell that demonstrates the answer.
Every lesson opens with the questions it answers, by id, and ends with *common wrong
answers*: the mistakes in the source collections' own answers, corrected and, where
possible, disproved by a test. A lesson marked *planned* is not written yet.

Drill the questions with `tinyscale quiz` (our short answer to each). This page is generated
from `src/tinyscale/course/questions.yaml` by `python -m tinyscale.course.bank --write`;
`pytest -k question_bank` checks that it is up to date, that every question is here, and that
every section and test it names exists.
"""


def render(questions: list[Question], headings: dict) -> str:
    groups = {g: [q for q in questions if q.group == g] for g in GROUPS}
    setup = sum(any(s.startswith("lessons/00-setup.md") for s in q.sections) for q in questions)
    lines = [INTRO.format(n=len(questions)), "| Lesson | Questions |", "|---|---|",
             f"| [00. Setup](lessons/00-setup.md) | {setup}, each counted under the lesson named after it "
             "(its runtime part is answered here) |"]
    lines += [f"| [{GROUPS[g]}](#{g}) | {len(qs)} |" for g, qs in groups.items() if qs]
    lines += [f"| **total** | **{len(questions)}** |", ""]
    for g, qs in groups.items():
        if not qs:
            continue
        lines += [f"## {GROUPS[g]} {{ #{g} }}", ""]
        for tag in dict.fromkeys(q.tag for q in qs):
            lines += [f"### `{tag}`", "", "| Id | Tag | Question | Proof | Lesson |", "|---|---|---|---|---|"]
            lines += [f"| `{q.id}` | `{q.tag}` | {_cell(q.question)} | {_proof_cell(q)} | {_lesson_cell(q, headings)} |"
                      for q in qs if q.tag == tag]
            lines.append("")
    return "\n".join(lines)


def repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tinyscale.course.bank", description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate docs/questions.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if docs/questions.md is out of date")
    args = parser.parse_args(argv)
    root = repo_root()
    page = root / "docs" / "questions.md"
    text = render(load(), lesson_headings(root))
    if args.write:
        page.write_text(text)
        print(f"wrote {page}")
        return 0
    if page.read_text() != text:
        print(f"{page} is out of date: edit src/tinyscale/course/questions.yaml (not the page), "
              "then run python -m tinyscale.course.bank --write")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
