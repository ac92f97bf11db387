"""Options read before tests/ is collected, so they work with a bare `pytest` (testpaths).

`--impl DIR`: run the tests against your exercises in DIR (`tinyscale exercise start TOPIC`)
instead of tinyscale's code; tests/conftest.py installs them (tinyscale.course.impl).

Triton's interpreter: tinyscale.kernels run under it on a machine without a GPU, and Triton
decides when a kernel is defined (at import), so it is chosen here, before anything imports
tinyscale (tests/__init__.py does); rank processes inherit it. On a GPU the kernels compile.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--impl", metavar="DIR", default=None,
                     help="run the tests against your exercises in DIR (tinyscale exercise start TOPIC) "
                          "instead of tinyscale's code; only the started topics' tests run")
