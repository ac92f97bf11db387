"""`tinyscale exercise`: write a topic's key functions yourself, judged by the topic's own tests.

    tinyscale exercise list                   # the topics and the functions each asks for
    tinyscale exercise start ring_allreduce   # writes exercises/ring_allreduce/ring.py
    pytest --impl exercises -k ring_allreduce # the topic's tests, run against your file
    tinyscale exercise check ring_allreduce   # the same, summarised as a table

`start` copies our module with the bodies of the topic's key functions replaced by
`raise NotImplementedError(...)`: signatures, decorators and docstrings stay, and so does the
rest of the module, so your version can call the same helpers ours does.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tinyscale.course.topics import TOPICS, Topic

SNIPPET_MARKER = "# --8<--"


def _topic(name: str) -> Topic:
    if name not in TOPICS:
        raise ValueError(f"unknown exercise topic {name!r}: choose one of {', '.join(TOPICS)}")
    return TOPICS[name]


def _find(tree: ast.Module, stub: str) -> ast.FunctionDef:
    scope, names = tree.body, stub.split(".")
    for i, name in enumerate(names):
        kind = ast.ClassDef if i < len(names) - 1 else (ast.FunctionDef, ast.AsyncFunctionDef)
        node = next((n for n in scope if isinstance(n, kind) and n.name == name), None)
        if node is None:
            raise LookupError(f"{stub} not found")
        scope = node.body
    return node


def exercise_source(topic: Topic, *, stubbed: bool = True) -> str:
    """Our module's source, with the topic's functions' bodies removed (stubbed=True) or kept."""
    origin = Path(importlib.util.find_spec(topic.module).origin)
    lines = origin.read_text().splitlines()
    tree = ast.parse("\n".join(lines))
    if any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree)):
        raise ValueError(f"{origin} uses a relative import: exercises need absolute imports")
    edits = []
    for stub in topic.stubs if stubbed else ():
        fn = _find(tree, stub)
        body = fn.body
        has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str)
        start = body[1].lineno if has_doc and len(body) > 1 else (fn.end_lineno + 1 if has_doc else body[0].lineno)
        indent = " " * body[0].col_offset
        raise_line = f'{indent}raise NotImplementedError("exercise {topic.name}: write {stub}")'
        edits.append((start, fn.end_lineno, raise_line))
    for start, end, text in sorted(edits, reverse=True):
        lines[start - 1:end] = [text]
    header = (f"# Exercise {topic.name}: a copy of {topic.module} ({topic.lesson}).\n"
              f"# Write the bodies that raise NotImplementedError, then run\n"
              f"#     pytest --impl exercises -k {topic.name}      (or: tinyscale exercise check {topic.name})\n")
    return header + "\n".join(line for line in lines if SNIPPET_MARKER not in line) + "\n"


def start(name: str, directory: str | Path = "exercises", *, force: bool = False, stubbed: bool = True) -> Path:
    """Write the learner's copy of topic `name` into directory/name/; returns its path."""
    topic = _topic(name)
    path = Path(directory) / topic.name / topic.filename
    if path.exists() and not force:
        raise ValueError(f"{path} exists (your work?): keep it, or pass --force to start over")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(exercise_source(topic, stubbed=stubbed))
    return path


def repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


def run_tests(directory: str | Path, selection: list[str], *, keyword: str | None = None,
              timeout_s: float = 900) -> list[dict]:
    """Run pytest --impl `directory` on `selection` (test files or node ids) in a fresh process;
    one row per test: {"test", "outcome" (passed/failed/skipped), "message", "details" (the traceback)}."""
    root = repo_root()
    if not (root / "tests" / "conftest.py").is_file():
        raise ValueError(f"exercise check needs tinyscale's tests: run it from a checkout (no tests/ under {root})")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "--impl", str(Path(directory).resolve()), "-q",
               "-p", "no:cacheprovider", f"--junitxml={report}", *selection]
        if keyword:
            cmd += ["-k", keyword]
        done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout_s)
        if not report.exists():
            raise RuntimeError(f"pytest did not run:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        rows = []
        for case in ET.parse(report).iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            skipped = case.find("skipped")
            outcome = "failed" if bad is not None else "skipped" if skipped is not None else "passed"
            message = (bad if bad is not None else skipped).get("message", "") if outcome != "passed" else ""
            rows.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                         "message": message, "details": (bad.text or "") if bad is not None else ""})
    return rows


def cmd_list(console: Console) -> int:
    table = Table(title="exercise topics")
    for col in ("topic", "module", "you write", "lesson"):
        table.add_column(col, overflow="fold")
    for t in TOPICS.values():
        table.add_row(t.name, t.module, "\n".join(t.stubs), t.lesson)
    console.print(table)
    return 0


def cmd_check(name: str, directory: str, console: Console) -> int:
    topic = _topic(name)
    if not (Path(directory) / topic.name / topic.filename).is_file():
        raise ValueError(f"no {Path(directory) / topic.name / topic.filename}: run `tinyscale exercise start {name}` first")
    rows = run_tests(directory, list(topic.tests), keyword=topic.name)
    table = Table(title=f"exercise {name}: your {topic.filename} against the topic's tests")
    for col in ("test", "result", "why"):
        table.add_column(col, overflow="fold")
    style = {"passed": "green", "failed": "red", "skipped": "yellow"}
    for r in rows:
        table.add_row(r["test"].rsplit(".", 1)[-1], f"[{style[r['outcome']]}]{r['outcome']}[/]",
                      r["message"].splitlines()[0][:100] if r["message"] else "")
    console.print(table)
    counts = {k: sum(r["outcome"] == k for r in rows) for k in style}
    console.print(f"[bold]{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped[/bold]")
    return 0 if rows and counts["failed"] == 0 else 1


def cmd_exercise(args: argparse.Namespace, console: Console) -> int:
    if args.action == "list":
        return cmd_list(console)
    if args.action == "start":
        path = start(args.topic, args.dir, force=args.force)
        topic = TOPICS[args.topic]
        console.print(f"wrote [bold]{path}[/bold]: write {', '.join(topic.stubs)} (see {topic.lesson}), then\n"
                      f"    pytest --impl {args.dir} -k {topic.name}\n    tinyscale exercise check {topic.name}")
        return 0
    return cmd_check(args.topic, args.dir, console)


def add_parser(sub) -> None:
    ex = sub.add_parser("exercise", help="write a topic's key functions yourself, checked by its tests")
    actions = ex.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="the topics and the functions each asks you to write")
    for action, text in (("start", "write your copy of the topic into DIR/TOPIC/"),
                         ("check", "run the topic's tests against your copy and summarise")):
        a = actions.add_parser(action, help=text)
        a.add_argument("topic", choices=sorted(TOPICS), metavar="TOPIC", help=", ".join(TOPICS))
        a.add_argument("--dir", default="exercises", help="the exercises folder (default: ./exercises)")
        if action == "start":
            a.add_argument("--force", action="store_true", help="overwrite an existing copy")
