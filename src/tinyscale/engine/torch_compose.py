"""The engine's dp x tp layout built from PyTorch's own pieces, to agree with and to race.

    model = torch_composed_gpt(gpt, mesh)                           # in place, on every rank
    loss = model(ids, targets); loss.backward(); optimizer.step()     # a torch optimizer over its DTensors

What PyTorch composes here, the way torchtitan's `parallelize_llama` does (TP first, then FSDP):

- tensor parallelism: `parallelize_module` on each block with `torch_block_plan`
  (`tinyscale.tensor_parallel.dtensor_plan`: Q, K, V, gate and up by columns, the attention
  output and down projection by rows); the embedding, final norm and head stay whole on every
  TP rank (torchtitan splits them too, with `loss_parallel`, and then can run sequence
  parallelism; both are left out, so the agreement covers the blocks' layout);
- FSDP2 `fully_shard` over the dp axis of the same device mesh: each block, then the root
  (ZeRO stage 3's units), on parameters that are already TP DTensors: the 2-D (dp, tp) layout.

The engine does the same with `parallel.tensor` and `zero_optimization.stage` 3: the agreement
test (`pytest -k layout_torch`) trains both on the same batches, and `benchmarks/compose.py`
times them in the same run.
"""

from __future__ import annotations

import torch

from tinyscale.dist import ParallelMesh
from tinyscale.models.gpt import GPT
from tinyscale.tensor_parallel.dtensor_plan import torch_block_plan


def torch_composed_gpt(model: GPT, mesh: ParallelMesh) -> GPT:
    """TP (DTensor) over the mesh's tp axis, then FSDP2 over its dp axis, in place; returns `model`."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    device_mesh = mesh.device_mesh
    if mesh.size("tp") > 1:
        for block in model.blocks:
            parallelize_module(block, device_mesh["tp"], torch_block_plan(sequence_parallel=False))
    if mesh.size("dp") > 1:
        for block in model.blocks:  # the units ZeRO-3 uses by default: each block, then the root
            fully_shard(block, mesh=device_mesh["dp"])
        fully_shard(model, mesh=device_mesh["dp"])
    return model


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded parameters on CPU under the model's own keys (a collective on DTensors)."""
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().to("cpu", copy=True)
    return out
