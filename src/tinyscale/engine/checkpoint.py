"""What a training checkpoint holds, in a layout-free form, and the checks on loading it.

A checkpoint's live version (`tinyscale.engine.checkpoint_io`: versions, fsync, an atomic
pointer; checksums on load) is a torch.distributed.checkpoint directory of the
single-process model (`tinyscale.engine.dcp_checkpoint`: who writes which piece, and the
key layout), plus meta.json:

    model.<name>              full parameters, keyed like model.named_parameters() (fp32
                              masters under mixed precision), each written in pieces by the
                              ranks that own them
    optim.state.<name>.<key>  per-parameter optimizer state keyed by parameter NAME
    optim.param_groups.<i>.*  hyperparameters and parameter names of each group
    tinyscale.rank.<r>        rank r's random number generators (torch CPU, CUDA where present,
                              Python's `random`, numpy's, and under tensor parallelism the
                              dropout tracker's stream, `tp_tracker`) and compression state
    tinyscale.loss_scaler     fp16's loss scaler
    meta.json                 step, skipped steps (the LR schedule's position), the config, the
                              optimizer's class, the caller's `client_state` (the CLI's data
                              position), the world it was written from, and the files' SHA-256

Keys are parameter names and global offsets, never positions or shard indices, so a
checkpoint written by one layout (2 data-parallel ranks) loads into another (3 ranks, or one
process): the format knows nothing of how the state was split. Random states are per rank,
so they are the one part that depends on the layout: see `restore_rng`. `read` gives the
whole of it in one process (what `tinyscale checkpoint export` writes to one file).
"""

from __future__ import annotations

import hashlib
import random
import sys
from pathlib import Path

import torch

from tinyscale.engine import checkpoint_io
from tinyscale.engine.checkpoint_io import CheckpointError, CheckpointNotFound

__all__ = ["CheckpointError", "CheckpointNotFound", "check_compatible", "config_changes", "read", "restore_rng",
           "rng_state", "write"]


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
        raise CheckpointError(
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


# --8<-- [start:rng]
def rng_state(device: torch.device) -> dict:
    """This process's random generators: what dropout (and a user's own draws) will draw next."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    np = sys.modules.get("numpy")  # only if something imported it; saved as tensors (weights_only)
    if np is not None:
        kind, key, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = {"kind": kind, "key": torch.from_numpy(key.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "gauss": float(gauss)}
    return state


def _set_rng(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s["kind"], s["key"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["gauss"]))


def restore_rng(saved: dict | None, rank: int, world_size: int, device: torch.device) -> str | None:
    """Set this rank's generators from a checkpoint's rng.pt; return a warning if not exact.

    Rank r takes saved rank r's state. A rank the checkpoint has no state for (loading on
    more ranks than saved) seeds every generator from a hash of saved rank 0's torch state
    and r: deterministic, distinct per rank, but not what any uninterrupted run would draw.
    Whenever the world size differs, which rows a rank draws dropout masks for differs too,
    so exactness is promised only for the same world size; everything else (parameters,
    optimizer state, schedule, loss scale, and counter dropout masks, which need no generator)
    resumes exactly in any layout."""
    if saved is None:
        return "the checkpoint holds no random state (written by an older tinyscale): random draws restart"
    states = saved["ranks"]
    if rank in states:
        _set_rng(states[rank], device)
    else:
        digest = hashlib.sha256(states[0]["torch"].numpy().tobytes() + rank.to_bytes(4, "little")).digest()
        seed = int.from_bytes(digest[:8], "little") >> 1  # torch seeds are at most 2**63 - 1 here
        torch.manual_seed(seed)  # CPU and every CUDA device
        random.seed(seed)
        np = sys.modules.get("numpy")
        if np is not None:
            np.random.seed(seed % 2**32)
    if saved["world_size"] != world_size:
        return (f"the checkpoint was written by {saved['world_size']} ranks and is loaded on {world_size}: ranks "
                f"below {min(world_size, saved['world_size'])} take their saved random state, the others one "
                "derived from it, so stream dropout masks will not match an uninterrupted run (counter masks, "
                "GPTConfig.dropout_masks='counter', and all else resume exactly)")
    return None
# --8<-- [end:rng]


def check_compatible(path, meta: dict, model_state: dict, ours: dict[str, torch.Size], optimizer: str) -> None:
    """Refuse a checkpoint this engine cannot continue: another optimizer class, other
    parameter names, other shapes. Every difference is named at once. `model_state`: the
    checkpoint's parameters, name -> tensor or shape."""
    problems = []
    saved_optimizer = meta.get("optimizer_class")
    if saved_optimizer is not None and saved_optimizer != optimizer:
        problems.append(f"optimizer: the checkpoint holds {saved_optimizer}'s state, this engine steps with "
                        f"{optimizer}; configure {saved_optimizer} (or start a new run without the checkpoint)")
    missing = [k for k in ours if k not in model_state]
    unexpected = [k for k in model_state if k not in ours]
    if missing:
        problems.append(f"this model has {missing} which the checkpoint lacks")
    if unexpected:
        problems.append(f"the checkpoint has {unexpected} which this model lacks")
    saved = {k: tuple(v.shape) if torch.is_tensor(v) else tuple(v) for k, v in model_state.items()}
    shapes = [f"{k}: saved {v}, here {tuple(ours[k])}" for k, v in saved.items() if k in ours and v != tuple(ours[k])]
    if shapes:
        problems.append("shapes differ: " + "; ".join(shapes))
    if problems:
        raise CheckpointError(f"load_checkpoint: {path} does not fit this engine:\n  " + "\n  ".join(problems))


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(saved: dict | None, now: dict) -> list[str]:
    """'field: saved -> now' for every config field that differs (the new value is used)."""
    if saved is None:
        return []
    old, new = _flatten(saved), _flatten(now)
    return [f"{k}: {old.get(k, '(unset)')!r} -> {new.get(k, '(unset)')!r}"
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def write(path, model_state: dict, optimizer_state: dict, meta: dict, rng: dict | None = None) -> Path:
    """Write a checkpoint (call on one rank): crash-safe, see `tinyscale.engine.checkpoint_io`."""
    files = {"model.pt": model_state, "optimizer.pt": optimizer_state}
    if rng is not None:
        files["rng.pt"] = rng
    return checkpoint_io.write(path, files, meta)


def read(path) -> tuple[dict, dict, dict]:
    """Read and verify a whole checkpoint in one process: (model_state, optimizer_state, meta),
    the single-process model's state by name (`export` writes it to one file); meta["rng"]
    holds every rank's random state (None if the checkpoint has none). Any format: DCP's
    sharded one (3) or the single files of older versions (1, 2)."""
    from tinyscale.engine import dcp_checkpoint  # noqa: PLC0415 - it imports this module's users

    version = checkpoint_io.live_version(path)
    meta = checkpoint_io.read_meta(version)
    if meta["format_version"] < 3:
        files, meta = checkpoint_io.read(path)
        meta["rng"] = files.get("rng.pt")
        return files["model.pt"], files["optimizer.pt"], meta
    for f in meta["sha256"]:
        problem = dcp_checkpoint.check_files(version, {f: meta["sha256"][f]}, 0, 1)
        if problem is not None:
            raise CheckpointError(f"load_checkpoint: {problem}")
    model, optimizer, extra = dcp_checkpoint.read_whole(version)
    if dcp_checkpoint.SCALER in extra:
        optimizer["loss_scaler"] = extra[dcp_checkpoint.SCALER]
    ranks = {int(k[len(dcp_checkpoint.RANK):]): v for k, v in extra.items() if k.startswith(dcp_checkpoint.RANK)}
    meta["rng"] = {"world_size": meta["world_size"], "ranks": ranks} if ranks else None
    return model, optimizer, meta
