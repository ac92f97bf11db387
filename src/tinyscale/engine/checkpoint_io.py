"""Checkpoint files that survive a crash at any moment: versions, fsync, one atomic commit.

A checkpoint directory holds versions and a pointer to the live one:

    path/latest            the text "v000012": the live version
    path/v000012/          DCP's files (.metadata, __<rank>_0.distcp: `engine/dcp_checkpoint.py`),
                           meta.json (SHA-256 of the others)

A save makes a new version live in five steps (`POINTS` names the moments between them);
`begin` and `commit` are rank 0's part, every rank writes its own files in between
(`Engine.save_checkpoint`); `write` is the same for one rank's `torch.save` files:

1. write each file into a temporary directory path/.tmp-v000012-<pid>/ and fsync it;
2. write meta.json last, with the other files' SHA-256, fsync it and the directory;
3. rename the temporary directory to path/v000012 and fsync path (complete, not yet live);
4. write the pointer to path/.latest-<pid>, fsync it, `os.replace` it onto path/latest and
   fsync path: the commit. `os.replace` is atomic, so `latest` names either the old
   version or the new one, never neither;
5. delete the other versions and temporary directories left by crashed saves.

Until step 4, `latest` names the previous version, which step 5 of the previous save left
complete on disk; from step 4 on it names the new one. So there is no moment at which
`read(path)` finds no complete checkpoint (tests/engine/test_checkpoint_faults.py kills a
process at each point and loads). fsync makes the same hold across a power cut: without it
the rename can reach the disk before the data it names. What fsync costs is measured in
lessons/03-zero.md. `read` verifies each file's checksum before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

FORMAT_VERSION = 3  # 3: DCP's sharded files (engine/dcp_checkpoint.py); 1 and 2: one model.pt, optimizer.pt
REQUIRED = {1: ("model.pt", "optimizer.pt"), 2: ("model.pt", "optimizer.pt"), 3: (".metadata",)}
POINTER = "latest"
_VERSION = re.compile(r"v(\d{6,})")

# Fault injection for tests: called with the name of each point a save passes.
fault_hook: Callable[[str], None] | None = None
POINTS = ("temp_created", "files_written", "meta_written", "renamed", "pointer_written", "committed",
          "collected")
COMMIT = "committed"  # from this point on, read() returns the new version


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: names the file, what is wrong with it, and what to do."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """No checkpoint at the path given."""


def _reach(point: str) -> None:
    if fault_hook is not None:
        fault_hook(point)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make the directory's entries (a file created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _versions(path: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in path.iterdir() if (m := _VERSION.fullmatch(p.name)) and p.is_dir())


def begin(path: str | os.PathLike) -> tuple[Path, str]:
    """Steps before a save writes anything (call on one rank): make `path`, pick the next
    version's name, create its temporary directory; returns (that directory, the name)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"save_checkpoint: {path} is a file; a checkpoint is a directory: choose another path")
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    if created:
        _fsync_dir(path.parent)
    number = max(_versions(path), default=0) + 1
    name = f"v{number:06d}"
    tmp = path / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a failed save of this process (nothing commits it)
    tmp.mkdir()
    _reach("temp_created")
    return tmp, name


def commit(path: str | os.PathLike, tmp: Path, name: str, meta: dict, digests: dict[str, str]) -> Path:
    """Steps 2-5 once every file is in `tmp` and fsynced (call on one rank): meta.json with the
    files' SHA-256 `digests`, the rename, the pointer, the collection. Returns the version."""
    path = Path(path)
    try:
        meta = {**meta, "format_version": FORMAT_VERSION, "sha256": digests}  # step 2: meta.json last
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        _fsync_file(tmp / "meta.json")
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _reach("meta_written")
    # --8<-- [start:commit]
    os.rename(tmp, path / name)  # step 3: complete, not yet live
    _fsync_dir(path)
    _reach("renamed")
    pointer = path / f".{POINTER}-{os.getpid()}"  # step 4: the commit
    pointer.write_text(name + "\n")
    _fsync_file(pointer)
    _reach("pointer_written")
    os.replace(pointer, path / POINTER)
    _fsync_dir(path)
    _reach("committed")
    for old in path.iterdir():  # step 5: what no pointer names any more
        if old.name != name and (_VERSION.fullmatch(old.name) or old.name.startswith((".tmp-", f".{POINTER}-"))):
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
    _reach("collected")
    # --8<-- [end:commit]
    return path / name


def write(path: str | os.PathLike, files: dict[str, object], meta: dict) -> Path:
    """Write `files` (name -> object for torch.save) and meta.json as a new live version of
    the checkpoint at `path`; return the version's directory. Call on one rank."""
    tmp, name = begin(path)
    try:
        for file, obj in files.items():  # step 1
            torch.save(obj, tmp / file)
            _fsync_file(tmp / file)
        _reach("files_written")
        digests = {file: sha256(tmp / file) for file in files}
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit(path, tmp, name, meta, digests)


def live_version(path: str | os.PathLike) -> Path:
    """The directory holding the files of the checkpoint at `path` (its live version).

    `path` may also be a version directory itself (it holds meta.json)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointNotFound(f"load_checkpoint: {path} is not a checkpoint: it does not exist or is not a "
                                 "directory; check the path (save_checkpoint writes a directory)")
    pointer = path / POINTER
    if pointer.is_file():
        name = pointer.read_text().strip()
        if not _VERSION.fullmatch(name):
            raise CheckpointError(f"load_checkpoint: {pointer} should name a version like v000001 but holds "
                                  f"{name[:40]!r}: it was edited or damaged; write the name of a complete "
                                  f"version directory (one of {sorted(p.name for p in path.glob('v*'))}) into it")
        if not (path / name).is_dir():
            raise CheckpointError(f"load_checkpoint: {pointer} names {name}, but {path / name} does not exist: "
                                  "it was deleted; restore it or load an earlier checkpoint")
        return path / name
    if (path / "meta.json").is_file():
        return path
    raise CheckpointNotFound(f"load_checkpoint: {path} is not a checkpoint (no '{POINTER}' pointer, no meta.json): "
                             "pass the directory given to save_checkpoint")


def read_meta(version: Path) -> dict:
    """meta.json of a version directory, checked for the fields that verification needs."""
    meta_path = version / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"load_checkpoint: {meta_path} is missing: the checkpoint is incomplete; "
                              "load an earlier checkpoint")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"load_checkpoint: {meta_path} is not valid JSON ({exc}): the file is damaged; "
                              "restore it or load an earlier checkpoint") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"load_checkpoint: {meta_path} holds a {type(meta).__name__}, not an object: "
                              "it is damaged; restore it or load an earlier checkpoint")
    if meta.get("format_version") not in REQUIRED:
        raise CheckpointError(f"load_checkpoint: {meta_path} has format_version {meta.get('format_version')!r}; "
                              f"this tinyscale reads {sorted(REQUIRED)}: load it with the version that wrote it")
    digests = meta.get("sha256")
    if not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values()):
        raise CheckpointError(f"load_checkpoint: {meta_path} has no 'sha256' table ({{file: hex digest}}), so its "
                              "files cannot be verified: it was edited or not written by save_checkpoint; "
                              "load an earlier checkpoint")
    unlisted = [f for f in REQUIRED[meta["format_version"]] if f not in digests]
    if unlisted:
        raise CheckpointError(f"load_checkpoint: {meta_path} lists no checksum for {unlisted}: it was edited; "
                              "load an earlier checkpoint")
    return meta


def read(path: str | os.PathLike) -> tuple[dict[str, object], dict]:
    """Find the live version, verify every file against meta.json, load: (files, meta)."""
    version = live_version(path)
    meta = read_meta(version)
    for file, digest in meta["sha256"].items():
        if not (version / file).is_file():
            raise CheckpointError(f"load_checkpoint: {version / file} is missing (meta.json lists it): the "
                                  "checkpoint is incomplete; restore the file or load an earlier checkpoint")
        actual = sha256(version / file)
        if actual != digest:
            raise CheckpointError(f"load_checkpoint: {version / file} is corrupt (SHA-256 {actual[:12]}..., "
                                  f"expected {digest[:12]}...): restore it or load an earlier checkpoint")
    files = {}
    for file in meta["sha256"]:
        try:
            files[file] = torch.load(version / file, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - verified bytes that torch cannot read: say which file
            raise CheckpointError(f"load_checkpoint: {version / file} matches its checksum but cannot be "
                                  f"loaded ({type(exc).__name__}: {exc}); was it written by another torch?") from exc
    return files, meta
