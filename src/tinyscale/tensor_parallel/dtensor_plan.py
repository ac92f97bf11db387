"""Our GPT block's tensor-parallel layout written as PyTorch's own plan, for comparison.

`torch.distributed.tensor.parallel.parallelize_module(block, mesh, torch_block_plan(sp))`
shards a `tinyscale.models.gpt.Block` the way `parallelize_block` does (the plan torchtitan
writes for Llama): Q, K, V and the MLP's gate and up projections by columns, the attention
output and the MLP's down projection by rows; with sequence parallelism the norms run on
sequence shards and each sub-layer gathers its input first. The DTensor agreement test
(`pytest -k tp_dtensor`) and `benchmarks/tensor_parallel.py` both use it.
"""

from __future__ import annotations


def torch_block_plan(sequence_parallel: bool) -> dict:
    """{submodule name: ParallelStyle} for one Block (imports torch's DTensor API lazily)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan = {name: ColwiseParallel() for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.w_gate", "mlp.w_up")}
    if not sequence_parallel:
        return {**plan, "attn.wo": RowwiseParallel(), "mlp.w_down": RowwiseParallel()}
    return {**plan,
            "attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                       desired_input_layouts=(Replicate(), None, None)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "mlp.w_down": RowwiseParallel(output_layouts=Shard(1))}
