"""Options read before tests/ is collected, so they work with a bare `pytest` (testpaths).

`--impl DIR`: run the tests against your exercises in DIR (`tinyscale exercise start TOPIC`)
instead of tinyscale's code; tests/conftest.py installs them (tinyscale.course.impl).
"""


def pytest_addoption(parser):
    parser.addoption("--impl", metavar="DIR", default=None,
                     help="run the tests against your exercises in DIR (tinyscale exercise start TOPIC) "
                          "instead of tinyscale's code; only the started topics' tests run")
