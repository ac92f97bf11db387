"""What the site and the lessons claim, read from their markdown, and what is really there.

Each `check_*` function takes the repository root (a fake one in the checks' own tests)
and returns a list of problems, one line each, empty when every claim holds. Issue 18,
section 1; run with `pytest -k docs_claims`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path

DOC_GLOBS = ("README.md", "docs/*.md", "lessons/*.md")
ID = r"(?:DS|DT|OPT|BASIC)-\d+"

# PyTorch implementations a page may say we agree with, and the text a test must contain
# to make that comparison (searched in tests/**/*.py).
PYTORCH_EVIDENCE = {
    "ZeroRedundancyOptimizer": "ZeroRedundancyOptimizer",
    "fully_shard": "torch.distributed.fsdp",
    "DTensor": "torch.distributed.tensor",
    "torch.distributed.pipelining": "torch.distributed.pipelining",
    "PowerSGD": "powerSGD_hook",
    "distributed checkpointing": "torch.distributed.checkpoint",
    "DCP": "torch.distributed.checkpoint",
    "GradScaler": "GradScaler",
    "FlopCounterMode": "FlopCounterMode",
    "torch.utils.checkpoint": "torch.utils.checkpoint",
}
# A paragraph that says it compares with PyTorch: every implementation it names needs a test.
COMPARISON = re.compile(r"agreement with pytorch|compared with pytorch|against pytorch|pytorch's own", re.I)
# Paths in other projects that a page cites as a source (not ours to check).
EXTERNAL_PATHS = {"docs/performance.md"}  # torchtitan's, in lesson 06's table of reported MFU
PATH_PREFIXES = ("src/", "tests/", "lessons/", "docs/", "notebooks/", "benchmarks/", "scripts/")


def doc_files(root: Path) -> list[Path]:
    return sorted(p for g in DOC_GLOBS for p in root.glob(g))


def _code_spans(text: str) -> Iterable[str]:
    """Inline code and the lines of fenced code blocks."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    for block in fenced:
        yield from block.splitlines()
    yield from re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))


def _where(root: Path, path: Path) -> str:
    return str(path.relative_to(root))


def pytest_keys(root: Path) -> dict[str, set[str]]:
    """Every simple `-k KEY` a page mentions (inside code), with the pages that mention it."""
    keys: dict[str, set[str]] = {}
    for path in doc_files(root):
        for span in _code_spans(path.read_text()):
            for key in re.findall(r"(?:^|\s)-k\s+([A-Za-z_]\w*)(?=$|[\s`,)])", span):
                keys.setdefault(key, set()).add(_where(root, path))
    return keys


def check_pytest_keys(root: Path, test_ids: list[str]) -> list[str]:
    """A key selects a test when it is a substring of a test id (pytest -k, case-insensitive)."""
    lowered = [t.lower() for t in test_ids]
    return [f"`pytest -k {key}` selects no test (mentioned in {', '.join(sorted(pages))})"
            for key, pages in sorted(pytest_keys(root).items())
            if not any(key.lower() in t for t in lowered)]


def check_cli_commands(root: Path, run_help: Callable[[str], bool]) -> list[str]:
    """`tinyscale CMD` (or .venv/bin/tinyscale CMD) in code: `tinyscale CMD --help` must work."""
    problems, seen = [], {}
    for path in doc_files(root):
        for span in _code_spans(path.read_text()):
            span = re.sub(r"\s#\s.*$", "", span)  # a shell comment is prose
            for cmd in re.findall(r"(?:^|[\s/`])tinyscale\s+([a-z][\w-]*)", span):
                if cmd not in seen:
                    seen[cmd] = run_help(cmd)
                if not seen[cmd]:
                    problems.append(f"`tinyscale {cmd}` does not exist (mentioned in {_where(root, path)})")
    return problems


def _generated(root: Path) -> tuple[str, ...]:
    """Paths .gitignore names by their place in the tree (`docs/assets/vendor/`): a build step
    makes them, so a clean checkout lacks them and a mention of one cannot be checked here."""
    ignore = root / ".gitignore"
    lines = ignore.read_text().splitlines() if ignore.exists() else []
    return tuple(line.strip("/") for line in lines if "/" in line.strip("/") and not line.startswith("#"))


def check_paths(root: Path) -> list[str]:
    """A repository path written in code (`src/...`, `tests/...`, ...) must exist (unless
    it is a build output that .gitignore names)."""
    generated = _generated(root)
    problems = []
    for path in doc_files(root):
        for span in _code_spans(path.read_text()):
            for token in span.split():
                token = token.strip("`'\",;()")
                token = re.sub(r":[\w-]+$", "", token)  # snippet sections: file.py:name
                if token.startswith(PATH_PREFIXES) and re.fullmatch(r"[\w./-]+", token) \
                        and not re.search(r"[*<]|\bNN\b", token) and token not in EXTERNAL_PATHS \
                        and not token.rstrip("/").startswith(generated) and not (root / token).exists():
                    problems.append(f"{token} does not exist (mentioned in {_where(root, path)})")
    return sorted(set(problems))


def lesson_questions(root: Path) -> dict[str, set[str]]:
    """Lesson file name -> the ids in its "## The questions" section."""
    out = {}
    for path in sorted(root.glob("lessons/[0-9][0-9]-*.md")):
        section = re.search(r"^## The questions\n(.*?)(?=^## )", path.read_text() + "\n## end", re.S | re.M)
        out[path.name] = set(re.findall(ID, section.group(1))) if section else set()
    return out


def bank_rows(root: Path) -> dict[str, str]:
    """Question id -> the bank's lesson cell (a lesson link, or "planned: ...")."""
    rows = {}
    for line in (root / "docs/questions.md").read_text().splitlines():
        m = re.match(rf"\|\s*`({ID})`\s*\|.*\|\s*([^|]*?)\s*\|\s*$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def check_question_bank(root: Path) -> list[str]:
    """Planned in the bank but answered by a lesson, or answered by a lesson that does not list it."""
    answers = lesson_questions(root)
    problems = []
    for qid, cell in sorted(bank_rows(root).items()):
        by = sorted(name for name, ids in answers.items() if qid in ids)
        linked = re.findall(r"lessons/([0-9][0-9]-[\w-]+\.md)", cell)
        if cell.startswith("planned") and by:
            problems.append(f"{qid} is marked planned in docs/questions.md but {', '.join(by)} answers it")
        for name in linked:
            if qid not in answers.get(name, set()):
                problems.append(f"{qid}: docs/questions.md says {name} answers it; that lesson's question list does not")
    for name, ids in answers.items():
        for qid in sorted(ids - bank_rows(root).keys()):
            problems.append(f"{qid}, listed by {name}, is not in docs/questions.md")
    summary = (root / "docs/questions.md").read_text().split("## ", 1)[0]
    for name in answers:
        if name[:-3] not in summary:
            problems.append(f"{name} is missing from the question bank's table of lessons")
    return problems


def check_topic_map(root: Path) -> list[str]:
    """The home page's Status: "landed" exactly when the row's lesson file exists."""
    problems = []
    for line in (root / "docs/index.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] in ("Topic", "---"):
            continue
        link = re.search(r"\((lessons/[\w-]+\.md)\)", cells[2])
        want = "landed" if link and (root / link.group(1)).exists() else "planned"
        if cells[4] != want:
            problems.append(f"docs/index.md topic map: {cells[0]!r} says {cells[4]!r}, should be {want!r}")
    return problems


def check_pytorch_comparisons(root: Path) -> list[str]:
    """Every PyTorch implementation a comparison paragraph names is used by some test."""
    tests = "\n".join(p.read_text() for p in (root / "tests").rglob("*.py")
                      if "docs" not in p.relative_to(root / "tests").parts)  # not this file's table
    problems = []
    for path in doc_files(root):
        for para in re.split(r"\n\s*\n", path.read_text()):
            if not COMPARISON.search(para):
                continue
            for name, evidence in PYTORCH_EVIDENCE.items():
                if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", para) and evidence not in tests:
                    problems.append(f"{_where(root, path)} claims a comparison with {name}; no test uses {evidence}")
    return problems
