"""The site and the lessons claim only what exists: checked on the real pages, and each
check shown to fail on a fake repository whose pages make a false claim (issue 18, section 1).

    pytest -k docs_claims
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs import claims

ROOT = Path(__file__).resolve().parents[2]


def _session_is_the_default_suite(config: pytest.Config) -> bool:
    """This session collected what a bare `pytest` collects: the testpaths, no selection, no --thorough."""
    opt = config.getoption
    return (config.args_source == pytest.Config.ArgsSource.TESTPATHS and not opt("keyword") and not opt("markexpr")
            and not opt("deselect") and not opt("--thorough") and not opt("--impl") and not opt("lf", False)
            and not opt("last_failed", False))


@pytest.fixture(scope="session")
def test_ids(request) -> list[str]:
    """Every test id of the suite: this session's own when it runs the whole default suite (as `make
    test` does), else collected once by a `pytest --collect-only` (~9 s on 2 cores)."""
    if _session_is_the_default_suite(request.config):
        return [item.nodeid for item in request.session.items]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          str(ROOT / "tests")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    assert ids, f"collection found no tests:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    return ids


def _cli_help(cmd: str) -> bool:
    from tinyscale.cli import build_parser

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            build_parser().parse_args([cmd, "--help"])
    except SystemExit as stop:
        return stop.code == 0
    return True


def test_docs_claims_pytest_keys_select_tests(test_ids):
    assert claims.check_pytest_keys(ROOT, test_ids) == []


def test_docs_claims_cli_commands_exist(capsys):
    assert claims.check_cli_commands(ROOT, _cli_help) == []


def test_docs_claims_paths_exist():
    assert claims.check_paths(ROOT) == []


def test_docs_claims_question_bank_matches_the_lessons():
    assert claims.check_question_bank(ROOT) == []


def test_docs_claims_topic_map_status():
    assert claims.check_topic_map(ROOT) == []


def test_docs_claims_pytorch_comparisons_have_tests():
    assert claims.check_pytorch_comparisons(ROOT) == []


# --- each check fails when its claim is false: a fake repository --------------------------

BANK = """# Question bank

| Lesson | Questions |
|---|---|
| [00. Setup](#00-setup) | 2 |

## 00. Setup { #00-setup }

| Id | Tag | Question | Lesson |
|---|---|---|---|
| `DS-9` | `config` | q | [00. Setup](lessons/00-setup.md) |
| `DS-16` | `pp` | q | planned: 08-pipeline-parallel |
"""
LESSON = """# Setup

## The questions

- **DS-9**: the config.

## The idea

Run `pytest -k real_key` and `.venv/bin/tinyscale train --help`; the code is in `src/real.py`.
"""
INDEX = """# Home

| Topic | Package | Lesson | Tests | Status |
|---|---|---|---|---|
| Setup | `x` | [0. Setup](lessons/00-setup.md) | `-k real_key` | landed |
| Pipes | `y` | 08-pipeline | `-k real_key` | planned |

2. **Agreement with PyTorch's own implementation** where there is one: GradScaler.
"""


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "lessons").mkdir()
    (tmp_path / "src").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "src/real.py").write_text("")
    (tmp_path / "tests/test_real.py").write_text("from torch.amp import GradScaler\n")
    (tmp_path / "docs/questions.md").write_text(BANK)
    (tmp_path / "docs/index.md").write_text(INDEX)
    (tmp_path / "lessons/00-setup.md").write_text(LESSON)
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_docs_claims_fake_repository_passes_every_check(fake):
    ids = ["tests/test_real.py::test_real_key_works"]
    assert claims.check_pytest_keys(fake, ids) == []
    assert claims.check_cli_commands(fake, lambda cmd: cmd == "train") == []
    assert claims.check_paths(fake) == []
    assert claims.check_question_bank(fake) == []
    assert claims.check_topic_map(fake) == []
    assert claims.check_pytorch_comparisons(fake) == []


def test_docs_claims_fail_on_a_key_that_selects_nothing(fake):
    _edit(fake / "lessons/00-setup.md", "-k real_key", "-k no_such_key")
    assert claims.check_pytest_keys(fake, ["tests/test_real.py::test_real_key_works"]) == [
        "`pytest -k no_such_key` selects no test (mentioned in lessons/00-setup.md)"]


def test_docs_claims_fail_on_a_command_that_does_not_exist(fake):
    _edit(fake / "lessons/00-setup.md", "tinyscale train", "tinyscale exercise")
    assert claims.check_cli_commands(fake, lambda cmd: cmd == "train") == [
        "`tinyscale exercise` does not exist (mentioned in lessons/00-setup.md)"]
    # and with the real parser: `frobnicate` is not a command, `train` and `exercise` are
    assert not _cli_help("frobnicate") and _cli_help("train") and _cli_help("exercise")


def test_docs_claims_fail_on_a_missing_path(fake):
    (fake / "src/real.py").unlink()
    assert claims.check_paths(fake) == ["src/real.py does not exist (mentioned in lessons/00-setup.md)"]


def test_docs_claims_fail_when_a_question_is_planned_but_answered(fake):
    _edit(fake / "lessons/00-setup.md", "- **DS-9**: the config.", "- **DS-9**: the config.\n- **DS-16**: grids.")
    assert claims.check_question_bank(fake) == [
        "DS-16 is marked planned in docs/questions.md but 00-setup.md answers it"]


def test_docs_claims_fail_when_a_question_is_answered_by_a_lesson_that_does_not_list_it(fake):
    _edit(fake / "lessons/00-setup.md", "- **DS-9**: the config.", "")
    assert claims.check_question_bank(fake) == [
        "DS-9: docs/questions.md says 00-setup.md answers it; that lesson's question list does not"]


def test_docs_claims_fail_when_a_lesson_is_missing_from_the_bank_table(fake):
    _edit(fake / "docs/questions.md", "| [00. Setup](#00-setup) | 2 |\n", "")
    assert claims.check_question_bank(fake) == ["00-setup.md is missing from the question bank's table of lessons"]


def test_docs_claims_fail_on_a_stale_topic_status(fake):
    _edit(fake / "docs/index.md", "| `-k real_key` | landed |", "| `-k real_key` | in progress |")
    assert claims.check_topic_map(fake) == [
        "docs/index.md topic map: 'Setup' says 'in progress', should be 'landed'"]


def test_docs_claims_fail_on_a_pytorch_comparison_no_test_makes(fake):
    _edit(fake / "docs/index.md", "one: GradScaler.", "one: GradScaler, the PowerSGD hook.")
    assert claims.check_pytorch_comparisons(fake) == [
        "docs/index.md claims a comparison with PowerSGD; no test uses powerSGD_hook"]


def test_docs_claims_allow_a_build_output_only_where_gitignore_names_it(fake):
    # `make docs` creates docs/assets/vendor/; a clean checkout (where `make test` runs) lacks it
    _edit(fake / "lessons/00-setup.md", "`src/real.py`", "`src/real.py` and `docs/assets/vendor/`")
    assert claims.check_paths(fake) == ["docs/assets/vendor/ does not exist (mentioned in lessons/00-setup.md)"]
    (fake / ".gitignore").write_text("__pycache__/\ndocs/assets/vendor/\n")
    assert claims.check_paths(fake) == []
