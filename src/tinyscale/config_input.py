"""Reading a config: files into dicts, and validation errors into lines that name the field.

Strict types (`Int`, `Float`, `Bool`): a string or a boolean where a number belongs is an error,
JSON's int where a float belongs is not. Every failure is a `ConfigError` that names the file or the field and says what to change:
a missing file, a directory, a file that does not parse (with line and column), a key that
is not known (with the nearest known key, DeepSpeed's vocabulary included), a bad value.
Tests: ``pytest -k config_strict``.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError

from tinyscale.deepspeed_keys import KEYS


class ConfigError(ValueError):
    """An invalid configuration; the message names the field and the fix."""


class Section(BaseModel):
    """A config section: unknown keys are errors, values are frozen once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _a_number(value: Any) -> Any:
    # Strict types: JSON's `true` or `"8"` where a number belongs is a mistake, not a 1 or an 8.
    # An int where a float belongs is plain JSON (`"lr": 1`) and stays accepted, and so does an
    # integral float where an int belongs (`"reduce_bucket_size": 5e8`, as DeepSpeed's configs write it).
    if isinstance(value, bool):
        raise ValueError(f"must be a number, not the boolean {value!r}")
    if isinstance(value, str):
        raise ValueError(f"must be a number, not the string {value!r}; write the number without quotes")
    return value


Int = Annotated[int, BeforeValidator(_a_number)]
Float = Annotated[float, BeforeValidator(_a_number)]
Bool = Annotated[bool, Strict()]  # only true/false: not 1, not "yes"
PositiveInt = Annotated[Int, Field(gt=0)]


def read_file(path: Path) -> dict:
    """The dict a .json/.yaml file holds; every failure is a `ConfigError` naming the file (and,
    for a syntax error, the line and column the parser stopped at)."""
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; give the path of a .json or .yaml file in it")
    if path.suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(f"config file {path}: use a .json, .yaml or .yml file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {path}, line {exc.lineno}, column {exc.colno}: invalid JSON: "
                              f"{exc.msg}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError(f"config file {path}{where}: invalid YAML: {problem}") from None
        data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} holds a {type(data).__name__}, not a mapping of config keys "
                          "(e.g. {\"train_batch_size\": 8})")
    return data


def _known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the section at `loc` (for "did you mean" hints)."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        candidates = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not candidates:
            return []
        model = candidates[0]
    return list(model.model_fields)


def explain(err: ValidationError, model: type[BaseModel]) -> list[str]:
    """One line per error of validating `model`: the field's dotted name, what is wrong, the fix."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        where = ".".join(str(p) for p in loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            section = ".".join(str(part) for part in loc[:-1])  # DeepSpeed's keys of it are candidates too
            deepspeed = [k.path.rsplit(".", 1)[-1] for k in KEYS if (k.path.rpartition(".")[0]) == section]
            hint = difflib.get_close_matches(str(loc[-1]), _known_keys(model, loc) + deepspeed, n=1)
            fix = f"; did you mean '{hint[0]}'?" if hint else "; remove it"
            lines.append(f"config field '{where}': unknown key{fix}")
        else:
            got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"config field '{where}': {msg}{got}")
    return lines
