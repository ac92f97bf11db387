"""Suite-wide set-up: hypothesis profiles, the --thorough flag, and the rank pools' lifetime.

Distributed test bodies run on pooled ranks (tinyscale.testing.run_on_ranks); the pools
start on first use and stop when the session ends.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from tinyscale.testing import close_pools

# Distributed examples take tens of milliseconds to seconds: no per-example deadline, and
# data generation is cheap compared with the run, so the too-slow check is noise here.
_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               print_blob=True)
settings.register_profile("default", max_examples=8, **_common)
settings.register_profile("thorough", max_examples=100, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--thorough", action="store_true", default=False,
                     help="run hypothesis property tests with many more examples (slow)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--thorough"):
        settings.load_profile("thorough")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    close_pools()
