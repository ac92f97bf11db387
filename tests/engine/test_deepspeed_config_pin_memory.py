"""DeepSpeed's offload_optimizer.pin_memory and offload_param.pin_memory (issue 17): with a GPU,
the host tier's buffers are allocated pinned; without one (this machine), or with nvme, the
key is noted at start-up. What runs here is the seam: the allocation asks for pinned memory
when told a GPU exists. No GPU is faked. `pytest -k deepspeed_config_pin_memory`."""

from __future__ import annotations

import pytest
import torch

import tinyscale as ts
from tinyscale import EngineConfig
from tinyscale.config_deepspeed import runtime_notes
from tinyscale.models import TinyMLP
from tinyscale.zero import offload


def test_deepspeed_config_pin_memory_asks_for_pinned_host_memory_only_with_a_gpu():
    cpu = torch.device("cpu")
    assert offload.host_allocation(True, has_gpu=True) == {"device": cpu, "pin_memory": True}
    assert offload.host_allocation(True, has_gpu=False) == {"device": cpu, "pin_memory": False}
    assert offload.host_allocation(False, has_gpu=True) == {"device": cpu, "pin_memory": False}


@pytest.mark.parametrize("pin", [True, False])
def test_deepspeed_config_pin_memory_reaches_the_host_tier_allocations(pin, monkeypatch):
    asked, real = [], offload.host_allocation

    def as_if_a_gpu_existed(pin_memory, has_gpu):
        kwargs = real(pin_memory, has_gpu=True)
        asked.append(kwargs["pin_memory"])
        return {**kwargs, "pin_memory": False}  # what was asked is recorded; this CPU cannot pin

    monkeypatch.setattr(offload, "host_allocation", as_if_a_gpu_existed)
    engine = ts.initialize(TinyMLP(seed=0), {"train_batch_size": 4, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": pin},
        "offload_param": {"device": "cpu", "pin_memory": pin}}})
    units = len(engine.zero.sharded.units)
    assert asked == [pin] * (2 * units)  # every master shard and every parameter shard


def test_deepspeed_config_pin_memory_notes_say_where_it_has_no_effect():
    def notes(device, has_gpu):
        cfg = EngineConfig.load({"train_batch_size": 4, "zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": device, "pin_memory": True, "nvme_path": "/tmp"}}})
        return [n for n in runtime_notes(cfg, has_gpu=has_gpu) if "pin_memory" in n]
    assert notes("cpu", has_gpu=True) == []  # honoured: pinned
    assert "no effect without a GPU" in notes("cpu", has_gpu=False)[0]
    assert "no effect with nvme" in notes("nvme", has_gpu=True)[0]
    assert "nothing is offloaded" in notes("none", has_gpu=True)[0]
