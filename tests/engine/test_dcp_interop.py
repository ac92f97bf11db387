"""A way out, and a way in (`pytest -k dcp_interop`): tinyscale's checkpoint is an ordinary DCP
checkpoint of the single-process model in torch's own key layout (`engine/dcp_checkpoint.py`).

- torch's FSDP2 + DCP (`get_state_dict`, `dcp.save({"model": ..., "optim": ...})`, on gloo) writes
  a GPT checkpoint that tinyscale loads at ZeRO 3, and tinyscale's loads into FSDP2 (`set_state_dict`),
  model and optimizer both: every side's next step equals the others' (float64, rtol 1e-10: the
  reductions run in other orders, ~1e-15 per op).
- `tinyscale checkpoint export DIR OUT.pt` writes one torch.save file of the whole model (what
  torch's `dcp_to_torch_save` and DeepSpeed's zero_to_fp32 write), and `import` takes it back.

The GPT is untied here: torch's state_dict of a tied model names the table twice (embed.weight and
head.weight), tinyscale's once.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import tinyscale as ts
from tinyscale.cli import main as cli
from tinyscale.engine import checkpoint_io
from tinyscale.models import GPT
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks

from .test_dcp_checkpoint import BATCHES, RTOL, config, gpt


def untied(seed: int) -> GPT:
    model = gpt(seed)
    cfg = dataclasses.replace(model.config, tie_embeddings=False)
    return GPT(cfg, seed=seed, dtype=torch.float64)


def _fsdp2(seed: int):
    from torch.distributed.fsdp import fully_shard

    model = untied(seed)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _torch_step(model, opt, batch) -> float:
    """One step of the global batch: this rank's rows (contiguous blocks, as the engine's dp ranks)."""
    ids, targets = batch
    rows = ids.shape[0] // dist.get_world_size()
    mine = slice(dist.get_rank() * rows, (dist.get_rank() + 1) * rows)
    loss = model(ids[mine], targets[mine])
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _interop(path: str) -> tuple:
    model, opt = _fsdp2(7)
    _torch_step(model, opt, BATCHES[0])
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{path}/torch")
    cfg = config(dp=2, stage=3, gradient_clipping=0.0)
    engine = ts.initialize(untied(1), cfg)
    engine.load_checkpoint(f"{path}/torch")  # a plain DCP directory, written by torch
    ours = [engine.train_batch(BATCHES[1])]
    engine.save_checkpoint(f"{path}/ts")
    theirs = [_torch_step(model, opt, BATCHES[1])]
    fresh, fresh_opt = _fsdp2(3)
    msd, osd = get_state_dict(fresh, fresh_opt)  # torch's recipe: its state dict, filled by dcp.load
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(checkpoint_io.live_version(f"{path}/ts")))
    set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    back = _torch_step(fresh, fresh_opt, BATCHES[2])
    return ours + [engine.train_batch(BATCHES[2])], theirs + [_torch_step(model, opt, BATCHES[2])], back


def test_dcp_interop_torch_fsdp2_checkpoints_load_into_tinyscale_and_back(tmp_path):
    for ours, theirs, back in run_on_ranks(_interop, 2, str(tmp_path)):
        assert_losses_close(ours, theirs, rtol=RTOL)  # tinyscale went on from torch's checkpoint
        assert_losses_close([back], theirs[1:], rtol=RTOL)  # torch went on from tinyscale's


def test_dcp_interop_export_and_import_round_trip(tmp_path):
    """Export a checkpoint to one file (its "model" a plain state_dict), import it back: the engine
    that loads the import continues exactly like the one that saved; a plain state_dict imports
    as a model-only checkpoint, whose optimizer starts fresh."""
    engine = ts.initialize(gpt(), config())
    engine.train_batch(BATCHES[0])
    engine.save_checkpoint(tmp_path / "ckpt")
    assert cli(["checkpoint", "export", str(tmp_path / "ckpt"), str(tmp_path / "out.pt")]) == 0
    exported = torch.load(tmp_path / "out.pt", weights_only=False)
    plain = gpt(seed=3)
    plain.load_state_dict(exported["model"], strict=False)  # the tied head is the same tensor
    assert_state_dicts_close(plain.state_dict(), engine.full_state_dict(), rtol=0, atol=0)
    assert exported["tinyscale"]["meta"]["step"] == 1 and set(exported["optim"]["state"]) == set(exported["model"])
    assert cli(["checkpoint", "import", str(tmp_path / "out.pt"), str(tmp_path / "back")]) == 0
    resumed = ts.initialize(gpt(seed=3), config())
    resumed.load_checkpoint(tmp_path / "back")
    assert resumed.train_batch(BATCHES[1]) == engine.train_batch(BATCHES[1])
    torch.save(exported["model"], tmp_path / "weights.pt")
    assert cli(["checkpoint", "import", str(tmp_path / "weights.pt"), str(tmp_path / "weights")]) == 0
    weights = ts.initialize(gpt(seed=4), config())
    weights.load_checkpoint(tmp_path / "weights")
    assert weights.step == 0 and not weights.optimizer.state
    assert_state_dicts_close(weights.full_state_dict(), plain.state_dict(), rtol=0, atol=0)
