"""`tinyscale quiz`: flash cards from the question bank, driven through piped input (issue 16).

    pytest -k quiz
"""

from __future__ import annotations

import io
import re

import pytest

from tinyscale.cli import main
from tinyscale.course import bank, quiz


def run_quiz(monkeypatch, capsys, keys: str, *args: str) -> tuple[int, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(keys))
    code = main(["quiz", *args])
    return code, capsys.readouterr().out


def shown_ids(out: str) -> list[str]:
    return re.findall(r"\d+/\d+\s+((?:DS|DT|OPT|BASIC)-\d+)", out)


def test_quiz_reveals_the_answer_after_the_question_and_keeps_the_score(monkeypatch, capsys):
    code, out = run_quiz(monkeypatch, capsys, "\ny\n\nn\n\ny\n", "--count", "3", "--seed", "0")
    assert code == 0
    ids = shown_ids(out)
    assert len(ids) == 3 == len(set(ids))
    by_id = {q.id: q for q in bank.load()}
    flat = " ".join(out.split())
    for qid in ids:
        question, answer = " ".join(by_id[qid].question.split()), " ".join(by_id[qid].answer.split())
        assert flat.index(question) < flat.index("show the answer", flat.index(question)) < flat.index(answer)
    assert "Score: 2/3 known" in out


def test_quiz_same_seed_same_cards_and_topic_filters(monkeypatch, capsys):
    first = shown_ids(run_quiz(monkeypatch, capsys, "\ny\n" * 4, "--count", "4", "--seed", "7")[1])
    again = shown_ids(run_quiz(monkeypatch, capsys, "\ny\n" * 4, "--count", "4", "--seed", "7")[1])
    assert first == again
    code, out = run_quiz(monkeypatch, capsys, "\ny\n" * 20, "--topic", "03-zero", "--count", "20")
    zero = {q.id for q in bank.load() if q.group == "03-zero"}
    assert code == 0 and set(shown_ids(out)) == zero and f"Score: {len(zero)}/{len(zero)} known" in out
    assert shown_ids(run_quiz(monkeypatch, capsys, "\ny\n", "--topic", "zero3")[1]) == ["DS-13"]


def test_quiz_end_of_input_ends_cleanly_with_the_score_so_far(monkeypatch, capsys):
    code, out = run_quiz(monkeypatch, capsys, "", "--count", "2", "--seed", "1")
    assert code == 0 and "Score: 0/0 known (0 of 2 cards shown)" in out
    code, out = run_quiz(monkeypatch, capsys, "\ny\n\n", "--count", "2", "--seed", "1")
    assert code == 0 and "Score: 1/1 known (1 of 2 cards shown)" in out


def test_quiz_asks_again_until_y_or_n(monkeypatch, capsys):
    code, out = run_quiz(monkeypatch, capsys, "\nmaybe\nno\n", "--count", "1", "--seed", "3")
    assert code == 0 and "Answer y or n." in out and "Score: 0/1 known" in out


@pytest.mark.parametrize("args, words", [(["--topic", "zer0"], "--topic 'zer0' matches no question: choose one of"),
                                         (["--count", "0"], "--count must be at least 1")])
def test_quiz_bad_arguments_exit_2_naming_the_fix(monkeypatch, capsys, args, words):
    code, out = run_quiz(monkeypatch, capsys, "", *args)
    assert code == 2 and words in " ".join(out.split())
    assert "zero3" in quiz.topics(bank.load())
