"""Put a learner's exercise code in place of ours, so the topic's unchanged tests run against it.

`pytest --impl exercises` calls `install("exercises")` before the tests are imported, and sets
TINYSCALE_EXERCISES so that rank processes (which import the `tests` package to run a test
body) install the same code: `tests/__init__.py` calls `install_from_environment()`.

For each topic folder `exercises/TOPIC/` holding the topic's file, the named functions are
replaced wherever a tinyscale module holds ours (the defining module and every package that
re-exports it), and the named methods are set on our class, so every caller, ours included,
runs the learner's version.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

from tinyscale.course.topics import TOPICS, Topic

ENV = "TINYSCALE_EXERCISES"
_installed: dict[str, str] = {}  # topic -> the learner's file, once per process


def _load(topic: Topic, path: Path):
    name = f"tinyscale_exercise_{topic.name}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _replace_everywhere(original, replacement) -> None:
    for name, module in list(sys.modules.items()):
        if name == "tinyscale" or name.startswith("tinyscale."):
            for attr, value in list(vars(module).items()):
                if value is original:
                    setattr(module, attr, replacement)


def install_topic(topic: Topic, path: Path) -> None:
    """Our `topic.module` runs the learner's `topic.stubs` from `path` from now on."""
    ours, theirs = importlib.import_module(topic.module), _load(topic, path)
    for stub in topic.stubs:
        if "." in stub:
            cls_name, method = stub.split(".")
            learner_cls = getattr(theirs, cls_name, None)
            if learner_cls is None or method not in vars(learner_cls):
                raise ValueError(f"{path}: class {cls_name} with method {method} is missing (keep the names "
                                 f"`tinyscale exercise start {topic.name}` wrote)")
            setattr(getattr(ours, cls_name), method, vars(learner_cls)[method])
        else:
            if not hasattr(theirs, stub):
                raise ValueError(f"{path}: function {stub} is missing (keep the names "
                                 f"`tinyscale exercise start {topic.name}` wrote)")
            _replace_everywhere(getattr(ours, stub), getattr(theirs, stub))


def install(directory: str | os.PathLike) -> list[Topic]:
    """Install every topic that has its file under `directory`; returns those topics."""
    root = Path(directory).resolve()
    if not root.is_dir():
        raise ValueError(f"--impl {directory}: no such folder (make one with `tinyscale exercise start TOPIC`)")
    found = []
    for topic in TOPICS.values():
        path = root / topic.name / topic.filename
        if path.is_file():
            if _installed.get(topic.name) != str(path):
                install_topic(topic, path)
                _installed[topic.name] = str(path)
            found.append(topic)
    if not found:
        raise ValueError(f"--impl {directory}: no exercise in it (expected TOPIC/FILE.py, as written by "
                         f"`tinyscale exercise start TOPIC`; topics: {', '.join(TOPICS)})")
    return found


def install_from_environment() -> None:
    """In a rank process: install what the pytest process installed (it set TINYSCALE_EXERCISES)."""
    directory = os.environ.get(ENV)
    if directory:
        install(directory)
