"""Rank-aware output: print0 prints once; the logger tags every line with its rank."""

from __future__ import annotations

import contextlib
import io
import logging

from tinyscale.dist import get_logger, print0
from tinyscale.testing import run_on_ranks


def _outputs():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out):
        print0("hello from", "rank zero")
    logger = get_logger("tinyscale.test")
    handler = logging.StreamHandler(err)
    handler.setFormatter(logger.handlers[0].formatter)
    logger.handlers[0] = handler
    logger.info("step %d", 3)
    return out.getvalue(), err.getvalue()


def test_dist_print0_prints_once_and_logger_names_the_rank():
    results = run_on_ranks(_outputs, 3)
    assert [r[0] for r in results] == ["hello from rank zero\n", "", ""]
    assert [r[1] for r in results] == [f"[rank {r}/3] INFO step 3\n" for r in range(3)]


def test_dist_print0_without_a_process_group_is_rank_zero(capsys):
    print0("solo")
    assert capsys.readouterr().out == "solo\n"
