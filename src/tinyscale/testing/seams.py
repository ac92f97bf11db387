"""One seam between a topic's tests and the implementations they hold to the same properties.

A topic's tests never import an implementation directly: they are parametrised over a
table of named implementations, each given as an import string (``"package.module:attr"``
or ``"path/to/file.py:attr"``). Strings, not objects, because the test body runs in rank
processes: each rank resolves the string itself.

    DDP = implementations("ddp", {"naive": "tinyscale.data_parallel:NaiveDDP", ...})

    @pytest.mark.parametrize("impl", DDP)
    def test_ddp_...(impl): run_on_ranks(body, 2, impl)   # body calls resolve(impl)

A learner checks their own version with the unchanged tests by naming it in the
environment: ``TINYSCALE_IMPL_DDP=my_ddp.py:MyDDP pytest -k ddp`` adds it to the table as
"yours"; ``TINYSCALE_ONLY_YOURS=1`` runs it alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path


def implementations(topic: str, builtin: dict[str, str]) -> list:
    """`pytest.param`s (id = the name) for `topic`: the built-in ones plus the learner's, if named."""
    import pytest

    table = dict(builtin)
    yours = os.environ.get(f"TINYSCALE_IMPL_{topic.upper()}")
    if yours is not None:
        table = {"yours": yours} if os.environ.get("TINYSCALE_ONLY_YOURS") else {**table, "yours": yours}
    return [pytest.param(spec, id=name) for name, spec in table.items()]


def resolve(spec: str):
    """Import ``"package.module:attr"`` or ``"path/to/file.py:attr"`` and return the attribute."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"implementation {spec!r} must look like 'package.module:name' or 'file.py:name'")
    if module_name.endswith(".py"):
        path = Path(module_name).resolve()
        if not path.exists():
            raise ValueError(f"implementation file {path} does not exist")
        name = f"tinyscale_learner_{path.stem}"
        module = sys.modules.get(name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = module
            loader_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{module_name} has no attribute {attr!r} (from implementation {spec!r})") from None
