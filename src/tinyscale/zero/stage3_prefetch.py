"""How far stage 3 prefetches: DeepSpeed's ``stage3_prefetch_bucket_size`` and ``stage3_max_live_parameters``.

When a unit starts its forward (or its backward), stage 3 may start all-gathering the units
that run after it, so that their gathers overlap this unit's compute (`stage3.py`). Two of
DeepSpeed's keys bound that, counted in *elements of gathered parameters* (a unit's elements
are its flat buffers', padding included: what an all-gather allocates):

- ``stage3_prefetch_bucket_size`` (b): units are taken in the order they will run while the
  elements already being prefetched are fewer than b, as DeepSpeed's coordinator does: b = 0
  prefetches nothing, any b > 0 at least one unit, a large b every unit ahead. None
  (tinyscale's default): exactly one unit ahead.
- ``stage3_max_live_parameters`` (m): a unit is prefetched only if the elements gathered at
  once (the units in use, those already prefetched, and it) stay at most m. A unit that is
  needed *now* is gathered whatever the count, so the guarantee is: prefetching never takes the
  gathered elements above m (the root unit, gathered through the whole forward, and the unit
  in use count towards m; persistent parameters, always whole, do not).

    n = units_to_prefetch([4096, 4096, 4096], live=8200, bucket=5000, max_live=20000)   # 2

Units already gathered are not candidates. Lesson: lessons/03-zero.md, "Prefetching".
Tests: ``pytest -k deepspeed_config_prefetch`` (and ``-k deepspeed_config_max_live``).
"""

from __future__ import annotations

from collections.abc import Sequence


def units_to_prefetch(upcoming: Sequence[int], live: int, bucket: int | None, max_live: int | None) -> int:
    """How many of the `upcoming` units (their element counts, in the order they will run) to
    all-gather now, `live` elements being gathered already. Pure: the rule, testable alone."""
    limit = 1 if bucket is None else len(upcoming)
    count = prefetching = 0
    for numel in upcoming[:limit]:
        if bucket is not None and prefetching >= bucket:
            break  # DeepSpeed's test: stop once the bucket is reached, not before adding
        if max_live is not None and live + prefetching + numel > max_live:
            break  # later units wait: the ones in between run first
        count, prefetching = count + 1, prefetching + numel
    return count
