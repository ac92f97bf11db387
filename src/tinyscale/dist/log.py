"""Rank-aware printing and logging: `print0` prints once, `get_logger` tags every line.

Never shadow `print`: with N ranks, a bare print shows N interleaved copies.
"""

from __future__ import annotations

import logging
import sys

from tinyscale.dist.runtime import rank, world_size


def print0(*args, **kwargs) -> None:
    """`print` on rank 0 only (every rank when not distributed is rank 0)."""
    if rank() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = rank()
        record.world_size = world_size()
        return True


def get_logger(name: str = "tinyscale", level: int = logging.INFO) -> logging.Logger:
    """A logger whose lines start with ``[rank r/n]``."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RankFilter) for f in logger.filters):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[rank %(rank)d/%(world_size)d] %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.addFilter(_RankFilter())
        logger.propagate = False
    logger.setLevel(level)
    return logger
