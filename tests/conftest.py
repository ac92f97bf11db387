"""Suite-wide set-up: hypothesis profiles, the --thorough and --impl flags, and the rank pools' lifetime.

Distributed test bodies run on pooled ranks (tinyscale.testing.run_on_ranks); the pools
start on first use and stop when the session ends.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

from tinyscale.dist import procs
from tinyscale.testing import close_pools

# A pooled rank unpickles each test body by importing its test module, which imports pytest and
# hypothesis: 0.4 s of CPU per rank process without this, and the suite starts rank processes
# by the hundred (pools for 2, 3 and 4 ranks, each restarted after a test that fails a rank on
# purpose, and every `launch`). Imported once in the forkserver instead, before any rank starts.
procs.add_preload("pytest", "hypothesis")

# This process's own work (float64 references, tiny models) gets one thread; rank processes set
# theirs (cores / ranks, tinyscale.dist.runtime). On the shared 2 cores torch's default 2 threads
# mostly spin-wait: `tests/engine -k layout_matrix` took 73, 44, 37 s with one thread against
# 103, 81, 136 s with 2 (pytest's times, 3 alternated pairs in one run, 2026-11-26, load 16 to 48).
torch.set_num_threads(1)

# Distributed examples take tens of milliseconds to seconds: no per-example deadline, and
# data generation is cheap compared with the run, so the too-slow check is noise here.
_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               print_blob=True)
settings.register_profile("default", max_examples=8, **_common)
settings.register_profile("thorough", max_examples=100, **_common)
# A learner's stub fails every example at once: shrinking and explaining that failure took a
# minute on a property whose examples cost ~0.2 s each, and tells them nothing more.
settings.register_profile("exercise", max_examples=8, phases=[Phase.explicit, Phase.reuse, Phase.generate],
                          **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--thorough", action="store_true", default=False,
                     help="run hypothesis property tests with many more examples (slow)")


def _deselect_thorough(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`@pytest.mark.thorough` tests run only with --thorough: deselected (not skipped) otherwise,
    so the default suite's summary counts what it ran."""
    if config.getoption("--thorough"):
        return
    keep = [item for item in items if item.get_closest_marker("thorough") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("thorough")])
        items[:] = keep


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--thorough"):
        settings.load_profile("thorough")
    if config.getoption("--impl"):  # the option: conftest.py at the repository root
        # Before any test module imports tinyscale's functions; rank processes read the
        # environment (tests/__init__.py) and install the same code.
        from tinyscale.course import impl

        try:
            config._exercise_topics = impl.install(config.getoption("--impl"))
        except ValueError as err:
            raise pytest.UsageError(str(err)) from None
        os.environ[impl.ENV] = str(Path(config.getoption("--impl")).resolve())
        if not config.getoption("--thorough"):
            settings.load_profile("exercise")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _deselect_thorough(config, items)
    topics = getattr(config, "_exercise_topics", None)
    if topics is None:
        return
    files = {f for t in topics for f in t.tests}
    keep = [i for i in items if i.nodeid.split("::")[0] in files]
    config.hook.pytest_deselected(items=[i for i in items if i.nodeid.split("::")[0] not in files])
    items[:] = keep


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    close_pools()
