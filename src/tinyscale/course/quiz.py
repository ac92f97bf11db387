"""`tinyscale quiz`: flash cards from the question bank, in the terminal.

    tinyscale quiz                        # 10 random questions
    tinyscale quiz --topic zero --count 5 --seed 1

Each card shows a question; Enter reveals our answer and where it is proven; then you say
whether you knew it (y/n). The score of the run is printed at the end, or when the input ends
(Ctrl-D, or a pipe that runs dry).
"""

from __future__ import annotations

import argparse
import random
import sys

from rich.console import Console

from tinyscale.course.bank import Question, load


def topics(questions: list[Question]) -> list[str]:
    """What --topic accepts: every tag and every lesson (its file stem, with or without the number)."""
    names = {q.tag for q in questions} | {q.group for q in questions} | {q.group[3:] for q in questions}
    return sorted(names)


def select(questions: list[Question], topic: str | None, count: int, seed: int | None) -> list[Question]:
    if count < 1:
        raise ValueError(f"--count must be at least 1, got {count}")
    if topic is not None:
        chosen = [q for q in questions if topic in (q.tag, q.group, q.group[3:])]
        if not chosen:
            raise ValueError(f"--topic {topic!r} matches no question: choose one of {', '.join(topics(questions))}")
        questions = chosen
    return random.Random(seed).sample(questions, min(count, len(questions)))


def _ask(console: Console, prompt: str) -> str:
    """One line of input; EOFError when the input has ended."""
    reply = console.input(prompt).strip().lower()
    if not sys.stdin.isatty():  # piped input is not echoed: end the prompt's line ourselves
        console.print()
    return reply


def run(console: Console, cards: list[Question]) -> tuple[int, int]:
    """Show the cards; returns (known, asked). Ends early, cleanly, at the end of the input."""
    known = asked = 0
    try:
        for n, q in enumerate(cards, 1):
            console.rule(f"[bold]{n}/{len(cards)}[/bold]  {q.id}  [dim]{q.tag}[/dim]")
            console.print(q.question)
            _ask(console, "[dim](Enter: show the answer)[/dim] ")
            console.print(f"[green]{q.answer}[/green]")
            where = ", ".join(q.sections) or f"lesson {q.planned} (planned)"
            console.print(f"[dim]lesson: {where}[/dim]")
            if q.proof:
                console.print(f"[dim]proof: {', '.join(q.proof)}[/dim]")
            while True:
                reply = _ask(console, "Did you know it? \\[y/n] ")
                if reply in ("y", "yes", "n", "no"):
                    break
                console.print("Answer y or n.")
            asked += 1
            known += reply.startswith("y")
    except (EOFError, KeyboardInterrupt):
        console.print()
        console.print("[dim](input ended)[/dim]")
    return known, asked


def cmd_quiz(args: argparse.Namespace, console: Console) -> int:
    cards = select(load(), args.topic, args.count, args.seed)
    known, asked = run(console, cards)
    console.print(f"[bold]Score: {known}/{asked}[/bold] known" + (f" ({asked} of {len(cards)} cards shown)"
                                                                  if asked < len(cards) else ""))
    return 0


def add_parser(sub) -> None:
    q = sub.add_parser("quiz", help="flash cards from the question bank, with our answers")
    q.add_argument("--topic", help="a tag (zero3, mixed-precision, ...) or a lesson (03-zero or zero)")
    q.add_argument("--count", type=int, default=10, help="cards in this run (default: 10)")
    q.add_argument("--seed", type=int, default=None, help="fix the order of the cards")
