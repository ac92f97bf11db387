"""The engine's layouts built from PyTorch's own pieces, to agree with and to race.

    model = torch_composed_gpt(gpt, mesh)                           # dp x tp, in place, on every rank
    loss = model(ids, targets); loss.backward(); optimizer.step()     # a torch optimizer over its DTensors

    schedule, stage = torch_pipelined_gpt(gpt, mesh, microbatches)  # dp x pp x tp (untied GPT)
    loss = pipelined_step(schedule, mesh, ids, targets); optimizer.step()  # optimizer over stage.parameters()

What PyTorch composes here, the way torchtitan's `parallelize_llama` does (TP first, then FSDP):

- tensor parallelism: `parallelize_module` on each block with `torch_block_plan`
  (`tinyscale.tensor_parallel.dtensor_plan`: Q, K, V, gate and up by columns, the attention
  output and down projection by rows); the embedding, final norm and head stay whole on every
  TP rank (torchtitan splits them too, with `loss_parallel`, and then can run sequence
  parallelism; both are left out, so the agreement covers the blocks' layout);
- FSDP2 `fully_shard` over the dp axis of the same device mesh: each block, then the root
  (ZeRO stage 3's units), on parameters that are already TP DTensors: the 2-D (dp, tp) layout;
- pipeline parallelism over the pp axis (`torch_pipelined_gpt`, torchtitan's pp + TP + FSDP):
  this pp rank's `tinyscale.pipeline.GPTStage` (the engine's cut), its blocks split over tp as
  above, `fully_shard` over dp (each block, then the stage), inside
  `torch.distributed.pipelining.PipelineStage`, run by
  `Schedule1F1B` (its `scale_grads` divides the accumulated gradients by the micro-batch
  count; FSDP2 averages them over dp in the last micro-batch's backward). FSDP2, not DDP: on
  CPU gloo (torch 2.13) a DDP-wrapped stage fails under Schedule1F1B (the reducer's bucket
  rebuild counts each parameter once per micro-batch and asserts at the second step; with
  `static_graph=True` it runs but trains to different losses). Untied GPTs only (a tied head's
  two copies would need their gradients summed across stages; torchtitan does not tie either).
  One stage per rank (no interleaving) and no gradient clipping on torch's side.

The engine does the same with `parallel.tensor`, `parallel.pipeline` (1f1b) and
`zero_optimization.stage` 3 (or 0): the agreement test (`pytest -k layout_torch`) trains both
on the same batches, and `benchmarks/compose.py` (`--pp 2` for the pipeline) times them in the
same run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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


def torch_pipelined_gpt(model: GPT, mesh: ParallelMesh, microbatches: int, *, reshard_after_forward: bool = True):
    """PyTorch's 1F1B pipeline over the mesh's pp axis, DTensor TP over tp, FSDP2 over dp; returns
    `(schedule, stage)`: torch's `Schedule1F1B` and this rank's `GPTStage` (sharing `model`'s modules;
    give the optimizer `stage.parameters()`).

    The stage is this pp rank's `tinyscale.pipeline.GPTStage` (the engine's cut, `partition_gpt`),
    its blocks `parallelize_module`d over tp (`torch_block_plan`), `fully_shard` over dp (each
    block, then the stage: ZeRO-3's units; `reshard_after_forward=False` keeps the gathered
    parameters until the backward, ZeRO-2's memory), then `PipelineStage` over the pp group. Untied models only: a tied head would need its two copies' gradients summed
    across stages, which `PipelineStage` does not do (torchtitan does not tie either).
    """
    import torch.distributed.pipelining as pipelining
    from torch.distributed.fsdp import fully_shard

    from tinyscale.pipeline import GPTStage, gpt_loss, partition_gpt, stages_on_rank

    if model.config.tie_embeddings:
        raise ValueError("torch_pipelined_gpt: untie the embedding (GPTConfig.tie_embeddings=False): "
                         "torch's PipelineStage does not sum the two stages' copies' gradients")
    pp, rank = mesh.size("pp"), mesh.rank("pp")
    spec, = stages_on_rank(partition_gpt(model.config, pp), rank)
    stage = GPTStage(model, spec)
    if mesh.size("tp") > 1:  # as torch_composed_gpt: the stage's blocks split over tp, before FSDP2
        from torch.distributed.tensor.parallel import parallelize_module

        for block in stage.blocks:
            parallelize_module(block, mesh.device_mesh["tp"], torch_block_plan(sequence_parallel=False))
    if mesh.size("dp") > 1:
        for block in stage.blocks:
            fully_shard(block, mesh=mesh.device_mesh["dp"], reshard_after_forward=reshard_after_forward)
        fully_shard(stage, mesh=mesh.device_mesh["dp"], reshard_after_forward=reshard_after_forward)
    device = next(stage.parameters()).device
    pipe = pipelining.PipelineStage(stage, rank, pp, device, group=mesh.group("pp"))
    return pipelining.Schedule1F1B(pipe, microbatches, loss_fn=gpt_loss), stage  # scale_grads: / microbatches


def pipelined_step(schedule, mesh: ParallelMesh, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One forward + backward of `ids`/`targets` (this dp rank's rows) through `schedule`; the
    global mean loss on every rank (the last stage's micro-batch losses, averaged over dp)."""
    first, last = mesh.rank("pp") == 0, mesh.rank("pp") == mesh.size("pp") - 1
    losses: list[torch.Tensor] = []
    kwargs = {"target": targets, "losses": losses} if last else {}
    schedule.step(*([ids] if first else []), **kwargs)
    mean = torch.stack(losses).mean().detach() if last else torch.zeros((), dtype=torch.float64)
    mean = mean.to(torch.float64)
    dist.all_reduce(mean)  # only the last stage's dp x tp ranks contribute (tp ranks hold the same loss)
    return mean / (mesh.size("dp") * mesh.size("tp"))
