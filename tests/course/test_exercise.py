"""Exercise mode: `tinyscale exercise start` writes stubs that fail the topic's own tests, our
own code in the same files passes them, and `pytest --impl` / `exercise check` run the tests
against the learner's file (issue 16).

    pytest -k exercise
"""

from __future__ import annotations

import ast
import importlib.util
import io
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rich.console import Console

from tinyscale.cli import main
from tinyscale.course import exercise, impl
from tinyscale.course.topics import TOPICS


def _function(tree: ast.Module, stub: str) -> ast.FunctionDef:
    return exercise._find(tree, stub)


def _docstring_and_rest(fn: ast.FunctionDef) -> tuple[str | None, list[ast.stmt]]:
    doc = ast.get_docstring(fn, clean=False)
    return doc, fn.body[1:] if doc is not None else fn.body


@pytest.mark.parametrize("name", list(TOPICS))
def test_exercise_stubs_keep_signatures_and_docstrings_and_only_remove_the_bodies(name):
    topic = TOPICS[name]
    ours = ast.parse(Path(importlib.util.find_spec(topic.module).origin).read_text())
    stubbed = ast.parse(exercise.exercise_source(topic))
    for stub in topic.stubs:
        mine, theirs = _function(ours, stub), _function(stubbed, stub)
        assert ast.dump(theirs.args) == ast.dump(mine.args)
        assert [ast.dump(d) for d in theirs.decorator_list] == [ast.dump(d) for d in mine.decorator_list]
        doc, rest = _docstring_and_rest(theirs)
        assert doc == ast.get_docstring(mine, clean=False)
        assert len(rest) == 1 and isinstance(rest[0], ast.Raise)
        assert ast.literal_eval(rest[0].exc.args[0]) == f"exercise {name}: write {stub}"
        assert rest[0].exc.func.id == "NotImplementedError"
    # everything else is ours: the same top-level names, and unstubbed functions unchanged
    names = lambda tree: [getattr(n, "name", None) for n in tree.body]  # noqa: E731
    assert names(stubbed) == names(ours)
    solution = ast.parse(exercise.exercise_source(topic, stubbed=False))
    assert ast.dump(solution) == ast.dump(ours)


def test_exercise_start_writes_the_copy_and_never_overwrites_work(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["exercise", "start", "mfu"]) == 0
    path = tmp_path / "exercises" / "mfu" / "mfu.py"
    assert 'raise NotImplementedError("exercise mfu: write mfu")' in path.read_text()
    assert "pytest --impl exercises -k mfu" in capsys.readouterr().out
    path.write_text(path.read_text() + "# my work\n")
    assert main(["exercise", "start", "mfu"]) == 2
    assert "exists (your work?)" in " ".join(capsys.readouterr().out.split())
    assert path.read_text().endswith("# my work\n")
    assert main(["exercise", "start", "mfu", "--force"]) == 0 and "# my work" not in path.read_text()
    assert main(["exercise", "list"]) == 0 and "ring_allreduce" in capsys.readouterr().out


def test_exercise_impl_without_exercises_names_the_command(tmp_path):
    with pytest.raises(ValueError, match="tinyscale exercise start TOPIC"):
        impl.install(tmp_path)
    with pytest.raises(ValueError, match="no such folder"):
        impl.install(tmp_path / "nowhere")


@pytest.fixture(scope="module")
def stubs_and_solutions(tmp_path_factory) -> tuple[Path, Path]:
    stubs, solutions = tmp_path_factory.mktemp("stubs"), tmp_path_factory.mktemp("solutions")
    for name in TOPICS:
        exercise.start(name, stubs)
        exercise.start(name, solutions, stubbed=False)  # our own code, copied into the exercise files
    return stubs, solutions


def _check(directory: Path) -> tuple[int, str]:
    """`exercise check scaler` on `directory`: its exit code and what it printed (a console of its own,
    so that two checks can run at once)."""
    out = io.StringIO()
    code = exercise.cmd_check("scaler", str(directory), Console(file=out, width=200))
    return code, " ".join(out.getvalue().split())


@pytest.fixture(scope="module")
def exercise_runs(stubs_and_solutions) -> dict:
    """Every pytest process this module starts, two at a time: every topic's quick tests once against
    the stubs and once against our code (one process each: a process costs ~7 s to start, the tests
    a few seconds), and `exercise check scaler` on each folder. The stubs' quick run is the longest
    (its failing ranks restart pools): it goes first, and the three others follow one another beside it.
    This process only waits. Measured in one session on 2 cores (load ~3): 22.1 and 22.9 s, against
    24.2 s (16.1 + 8.1) when the two checks ran as a pair of their own after the quick pair."""
    quick = sorted(q for t in TOPICS.values() for q in t.quick)
    stubs, solutions = stubs_and_solutions
    with ThreadPoolExecutor(2) as pool:
        jobs = {"stubs": pool.submit(exercise.run_tests, stubs, quick),
                "solutions": pool.submit(exercise.run_tests, solutions, quick),
                "check_stubs": pool.submit(_check, stubs), "check_solutions": pool.submit(_check, solutions)}
        return {name: job.result() for name, job in jobs.items()}


@pytest.fixture(scope="module")
def quick_rows(exercise_runs) -> dict[str, list[dict]]:
    """Every topic's quick tests, run against the stubs and against our code."""
    return {"stubs": exercise_runs["stubs"], "solutions": exercise_runs["solutions"]}


def _stubs_fail_and_ours_pass(quick_rows: dict[str, list[dict]], on_ranks: bool) -> None:
    quick = {q: t.name for t in TOPICS.values() if t.ranks == on_ranks for q in t.quick}
    assert quick, "no quick tests of this kind"

    def mine(rows):
        return [r for r in rows if any(q.split("::")[1] == r["test"].split("::")[1] for q in quick)]

    rows = mine(quick_rows["stubs"])
    assert len(rows) == len(quick)
    for row in rows:  # each fails because of its own topic's stub, not another's
        topic = next(name for q, name in quick.items() if q.split("::")[1] == row["test"].split("::")[1])
        assert row["outcome"] == "failed", row
        assert f"exercise {topic}: write" in row["details"] + row["message"], row
    rows = mine(quick_rows["solutions"])
    assert len(rows) == len(quick) and [r for r in rows if r["outcome"] != "passed"] == []


def test_exercise_stubs_fail_the_topic_tests_and_our_code_in_their_place_passes(quick_rows):
    _stubs_fail_and_ours_pass(quick_rows, on_ranks=False)


def test_exercise_stubs_fail_the_topic_tests_on_ranks_and_our_code_passes(quick_rows):
    _stubs_fail_and_ours_pass(quick_rows, on_ranks=True)


def test_exercise_check_summarises_the_topic_tests(exercise_runs, tmp_path, capsys):
    # The command line reaches the check (no copy yet: it names the command that writes one) ...
    assert main(["exercise", "check", "scaler", "--dir", str(tmp_path)]) == 2
    assert "tinyscale exercise start scaler" in " ".join(capsys.readouterr().out.split())
    # ... which runs the topic's tests against the stubs and against our code (exercise_runs).
    (code, out), (ours_code, ours_out) = exercise_runs["check_stubs"], exercise_runs["check_solutions"]
    assert code == 1
    failed = int(re.search(r"(\d+) passed, (\d+) failed", out).group(2))
    assert failed > 0 and "NotImplementedError" in out.replace(" ", "")
    assert ours_code == 0
    passed, failed = map(int, re.search(r"(\d+) passed, (\d+) failed", ours_out).groups())
    assert passed > 0 and failed == 0
