"""Test harness: run a function on N pooled ranks, and compare with the single process.

    from tinyscale.testing import run_on_ranks, assert_state_dicts_close
    results = run_on_ranks(body, 4, seed)     # body runs on 4 ranks of a reused pool

Used by tinyscale's own tests and by anyone checking their own implementation of a topic.
"""

from tinyscale.testing.equivalence import (
    FLOAT64_ATOL,
    FLOAT64_RTOL,
    assert_every_rank_trained_like,
    assert_losses_close,
    assert_state_dicts_close,
    max_abs_diff,
    state_dict_cpu,
    vocab_shard_boundary_ids,
    with_vocab_boundary_ids,
)
from tinyscale.testing.ops import CountOps
from tinyscale.testing.pool import DEFAULT_TIMEOUT_S, RankPool, close_pools, get_pool, run_on_ranks
from tinyscale.testing.seams import implementations, resolve

__all__ = [
    "CountOps",
    "DEFAULT_TIMEOUT_S",
    "FLOAT64_ATOL",
    "FLOAT64_RTOL",
    "RankPool",
    "assert_every_rank_trained_like",
    "assert_losses_close",
    "assert_state_dicts_close",
    "close_pools",
    "vocab_shard_boundary_ids",
    "with_vocab_boundary_ids",
    "get_pool",
    "implementations",
    "max_abs_diff",
    "resolve",
    "run_on_ranks",
    "state_dict_cpu",
]
