"""Offload (`pytest -k offload`): the host tier and the disk tier change where ZeRO's states
live, never the numbers: bit-identical training to the same stage without offload, the
float64 reference, the disk bytes in memory_report, and peak RSS measured in fresh processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import tinyscale as ts
from tests.zero.test_zero_stages import OPTIMIZERS, _setup, no_decay_on_biases
from tinyscale.config import ConfigError
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks
from tinyscale.zero.offload import DiskSwapper, return_freed_memory_to_os

# (offload_optimizer, offload_param) per stage; parameters offload only under stage 3
MODES = [(1, "cpu", "none"), (1, "nvme", "none"), (2, "nvme", "none"), (3, "cpu", "cpu"),
         (3, "nvme", "nvme"), (3, "none", "nvme")]


def _config(stage, optimizer_to, param_to, path, micro, accum, world, clip, optimizer):
    zero = {"stage": stage, "reduce_bucket_size": 300,  # ~ a layer per unit: the disk tier steps unit by unit
            "offload_optimizer": {"device": optimizer_to, "nvme_path": path if optimizer_to == "nvme" else None}}
    if stage == 3:
        zero["offload_param"] = {"device": param_to, "nvme_path": path if param_to == "nvme" else None}
    return {"train_batch_size": micro * accum * world, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accum, "gradient_clipping": clip, "optimizer": OPTIMIZERS[optimizer],
            "zero_optimization": zero, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}


def _train(kind, seed, config, steps, grouped):
    rows = ts.EngineConfig.load(config).batch(dist.get_world_size()).train_batch_size
    model, batches = _setup(kind, seed, rows, steps)
    engine = ts.initialize(model, config, param_groups=no_decay_on_biases if grouped else None)
    losses = [engine.train_batch(b) for b in batches]
    return losses, engine.full_state_dict(), engine.memory_report("now"), engine.memory_report("before_step")


@pytest.mark.parametrize("mode", MODES)
def test_offload_each_mode_trains_bit_identically_to_no_offload(tmp_path, mode):
    _check_offload(str(tmp_path), mode, "gpt", 3, 1, 2, 0.05, "adamw", True)


@given(mode=st.sampled_from(MODES), kind=st.sampled_from(["mlp", "gpt"]), world=st.sampled_from([2, 3, 4]),
       seed=st.integers(0, 2**16), accum=st.integers(1, 2), clip=st.sampled_from([0.0, 0.05]),
       optimizer=st.sampled_from(sorted(OPTIMIZERS)), grouped=st.booleans())
def test_offload_trains_bit_identically_to_no_offload_and_like_one_process(
        tmp_path_factory, mode, kind, world, seed, accum, clip, optimizer, grouped):
    _check_offload(str(tmp_path_factory.mktemp("nvme")), mode, kind, world, seed, accum, clip, optimizer, grouped)


def _check_offload(path, mode, kind, world, seed, accum, clip, optimizer, grouped):
    stage, optimizer_to, param_to = mode
    config = _config(stage, optimizer_to, param_to, path, 2, accum, world, clip, optimizer)
    plain = _config(stage, "none", "none", path, 2, accum, world, clip, optimizer)
    offloaded = run_on_ranks(_train, world, kind, seed, config, 3, grouped)
    baseline = run_on_ranks(_train, world, kind, seed, plain, 3, grouped)
    for (losses, state, now, before), (base_losses, base_state, base_now, _) in zip(offloaded, baseline):
        # offload moves bytes, it does not change arithmetic: equal, not close
        assert losses == base_losses
        assert all(torch.equal(state[k], base_state[k]) for k in state)
        # the same bytes are held, somewhere; on disk exactly what the mode sends there
        assert now.as_dict() == base_now.as_dict()
        on_disk = {c: now.bytes(c, "disk") for c in ("parameters", "master_weights", "optimizer_states")}
        assert (on_disk["master_weights"] > 0) == (optimizer_to == "nvme")
        assert (on_disk["optimizer_states"] > 0) == (optimizer_to == "nvme")
        assert (on_disk["parameters"] > 0) == (param_to == "nvme")
        if optimizer_to == "nvme":  # between steps nothing of the optimizer is in memory
            assert now.bytes("master_weights", "device") == 0 and before.bytes("master_weights", "device") == 0
            # Adam's per-tensor `step` counters (scalars) stay in memory; m and v are on disk
            assert now.bytes("optimizer_states", "device") <= 8 * 2 * len(state)
    model, batches = _setup(kind, seed, 2 * accum * world, 3)
    ref = ts.reference.train(model, batches, config, param_groups=no_decay_on_biases if grouped else None)
    assert_losses_close(offloaded[0][0], ref)
    assert_state_dicts_close(offloaded[0][1], model.state_dict())


def test_offload_disk_swapper_round_trips_bytes_and_bounds_what_is_resident(tmp_path):
    swap = DiskSwapper(tmp_path)
    tensors = {f"t{i}": torch.randn(1000 + i, dtype=torch.float64) for i in range(4)}
    copies = {k: t.clone() for k, t in tensors.items()}
    for k, t in tensors.items():
        swap.add(k, t)
    swap.flush()
    swap.reset_peak()
    assert swap.resident_bytes() == 0 and all(t.untyped_storage().nbytes() == 0 for t in tensors.values())
    assert swap.disk_bytes() == sum(t.numel() * 8 for t in copies.values())
    swap.prefetch(["t1"])  # on a thread
    with swap.resident(["t0", "t1"]):
        assert torch.equal(tensors["t0"], copies["t0"]) and torch.equal(tensors["t1"], copies["t1"])
        assert swap.resident_bytes() == (1000 + 1001) * 8
        tensors["t1"].add_(1.0)  # written back on the way out
    with swap.resident(["t1"]):
        assert torch.equal(tensors["t1"], copies["t1"] + 1.0)
    assert swap.peak_resident_bytes == (1000 + 1001) * 8  # the pair (and t1 while its write ran)
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        swap.add("strided", torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="already stored"):
        swap.add("t0", torch.zeros(3))
    directory = swap.directory
    swap.close()
    assert not directory.exists()


@pytest.mark.parametrize(("zero", "message"), [
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer.device needs zero_optimization.stage >= 1"),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "offload_param.device needs zero_optimization.stage 3"),
    ({"stage": 3, "offload_param": {"device": "nvme"}}, "offload_param.nvme_path is required"),
    ({"stage": 1, "offload_optimizer": {"device": "disk"}}, "offload_optimizer.device"),
])
def test_offload_bad_config_names_the_field_and_the_fix(zero, message):
    with pytest.raises(ConfigError, match=message):
        ts.EngineConfig.load({"train_batch_size": 2, "zero_optimization": zero})


# --- resident memory: peak RSS of fresh processes --------------------------------------

class _Deep(nn.Module):
    """Eight 512 x 512 float64 layers (16.8 MiB of parameters); forward returns the MSE loss."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(512, 512, dtype=torch.float64) for _ in range(8)])

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.layers(x), y)


def _peak_rss_kib() -> int:
    """This process's peak RSS since exec (VmHWM). Not getrusage's ru_maxrss: Linux keeps
    that across fork and exec, so a spawned rank would report its parent's (pytest's) peak."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _peak_rss(offload, path):
    """Train a model with ~33 MiB of float64 master + Adam state per rank (2 ranks, stage 2),
    then report this process's peak RSS and what the disk tier swapped."""
    return_freed_memory_to_os()  # in both runs (the disk tier sets it): the same allocator, only the swap differs
    torch.manual_seed(0)
    model = _Deep()
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": OPTIMIZERS["adamw"],
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 512 * 513,  # a layer per unit
                                    "offload_optimizer": {"device": offload, "nvme_path": path}}}
    engine = ts.initialize(model, config)
    for step in range(3):
        x = torch.randn(8, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        engine.train_batch((x, x.flip(1)))
    report = engine.memory_report("now")
    swap = engine.zero.sharded.swap
    peak_kib = _peak_rss_kib()
    swapped = report.bytes("master_weights", "disk") + report.bytes("optimizer_states", "disk")
    return peak_kib * 1024, swapped, swap.peak_resident_bytes if swap else 0


def test_offload_to_disk_lowers_peak_rss_by_what_it_swapped(tmp_path):
    # fresh processes (not the test pool): peak RSS is a high-water mark of a process's life
    plain = ts.dist.launch(_peak_rss, 2, "none", None, timeout_s=120)
    disk = ts.dist.launch(_peak_rss, 2, "nvme", str(tmp_path), timeout_s=120)
    for (rss_plain, _, _), (rss_disk, swapped, resident) in zip(plain, disk):
        state_bytes = 3 * 8 * (8 * 512 * 513) // 2  # master + exp_avg + exp_avg_sq of half the model
        assert swapped == pytest.approx(state_bytes, rel=0.01)  # padding: a few elements per unit
        # The disk tier keeps at most the unit being stepped, the next one being read and
        # the previous one being written (3 x 3 x 2 MiB here), so its peak RSS is lower by
        # everything else it swapped.
        assert resident <= 3 * 3 * 8 * 512 * 513 // 2 + 4096
        assert rss_plain - rss_disk >= swapped - resident, (rss_plain, rss_disk, swapped, resident)
