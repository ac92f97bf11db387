"""Saving and resuming training: atomic writes, checksums, and a layout-free format.

A checkpoint is a directory:

    path/model.pt       full parameters and buffers, keyed like model.state_dict()
    path/optimizer.pt   per-parameter optimizer state keyed by parameter NAME, plus hyperparameters
    path/meta.json      engine step, world layout it was written from, SHA-256 of the two files

Keys are parameter names, never positions or shard indices, so a checkpoint written by one
layout (2 data-parallel ranks) loads into another (3 ranks, or one process): the format
knows nothing of how the state was split. Strategies that shard state gather it into this
form on save and cut their own shards from it on load.

Writes are atomic: everything goes into a temporary sibling directory that is renamed
into place only when complete, so an interrupted save leaves the previous checkpoint
intact. Loads verify the checksums before touching the model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

FORMAT_VERSION = 1


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, names: dict[torch.Tensor, str]) -> dict:
    """The optimizer's state with parameters identified by name instead of by position."""
    state = {names[p]: {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in s.items()}
             for p, s in optimizer.state.items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
              for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def load_optimizer_state_by_name(optimizer: torch.optim.Optimizer, saved: dict,
                                 params: dict[str, torch.Tensor]) -> None:
    """Inverse of `optimizer_state_by_name` for an optimizer over the named `params`."""
    name_of = {id(p): name for name, p in params.items()}
    ours = [[name_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    theirs = [g["params"] for g in saved["param_groups"]]
    if ours != theirs:
        raise ValueError(
            "load_checkpoint: the checkpoint's optimizer covers different parameters than this "
            f"engine's (saved groups {theirs}, here {ours}); was it written for another model, or "
            "with other parameters frozen?"
        )
    index = {name: i for i, name in enumerate(n for group in ours for n in group)}
    optimizer.load_state_dict({
        "state": {index[name]: s for name, s in saved["state"].items()},
        "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                          "params": [index[n] for n in g["params"]]} for g in saved["param_groups"]],
    })


def write(path: str | os.PathLike, model_state: dict, optimizer_state: dict, meta: dict) -> None:
    """Write a checkpoint directory atomically (call on one rank)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        torch.save(model_state, tmp / "model.pt")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        meta = {**meta, "format_version": FORMAT_VERSION,
                "sha256": {name: _sha256(tmp / name) for name in ("model.pt", "optimizer.pt")}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        # Swap in: the old checkpoint survives until the new one is complete.
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read(path: str | os.PathLike) -> tuple[dict, dict, dict]:
    """Read and verify a checkpoint directory: (model_state, optimizer_state, meta)."""
    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"load_checkpoint: {path} is not a checkpoint (no meta.json)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"load_checkpoint: {path} has format {meta.get('format_version')}, "
                         f"this tinyscale reads {FORMAT_VERSION}")
    for name, digest in meta["sha256"].items():
        actual = _sha256(path / name)
        if actual != digest:
            raise ValueError(f"load_checkpoint: {path / name} is corrupt (SHA-256 {actual[:12]}..., "
                             f"expected {digest[:12]}...); restore it or use an earlier checkpoint")
    model_state = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
    optimizer_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    return model_state, optimizer_state, meta
