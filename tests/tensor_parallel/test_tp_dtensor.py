"""Our tensor-parallel block against PyTorch's own: DTensor `parallelize_module` with torchtitan's plan.

One GPT block (GQA attention, SwiGLU MLP, RMSNorms) split by `tinyscale.tensor_parallel.
parallelize_block` and by `torch.distributed.tensor.parallel.parallelize_module` with
ColwiseParallel (wq, wk, wv, w_gate, w_up), RowwiseParallel (wo, w_down) and, for sequence
parallelism, SequenceParallel on the norms with PrepareModuleInput gathering the sequence before
attention and the MLP (torchtitan's `apply_tp` plan). Same input, same output, same gradients of
the input and of every parameter (float64). Run: `pytest tests/tensor_parallel -k tp_dtensor`.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tinyscale.dist import ParallelMesh
from tinyscale.models import GPTConfig
from tinyscale.models.gpt import Block, rope_tables
from tinyscale.tensor_parallel import parallelize_block
from tinyscale.tensor_parallel.dtensor_plan import torch_block_plan
from tinyscale.testing import FLOAT64_ATOL, FLOAT64_RTOL, run_on_ranks


def _full_grads(block) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in block.named_parameters():
        owner = block.get_submodule(name.rpartition(".")[0])
        leaf = name.rpartition(".")[2]
        if hasattr(p.grad, "full_tensor"):  # DTensor
            out[name] = p.grad.full_tensor()
        elif hasattr(owner, "full_tensor"):  # ours
            out[name] = owner.full_tensor(leaf, p.grad)
        else:
            out[name] = p.grad
    return out


def dtensor_body(sequence_parallel: bool):
    n, r = dist.get_world_size(), dist.get_rank()
    cfg = GPTConfig(n_head=4, n_kv_head=2, d_model=16, ffn_hidden=24, max_seq_len=8)
    torch.manual_seed(0)  # the same full block on every rank
    dense = Block(cfg, dtype=torch.float64)
    with torch.no_grad():
        dense.attn_norm.weight.uniform_(0.5, 1.5)
        dense.mlp_norm.weight.uniform_(0.5, 1.5)
    ours, theirs = copy.deepcopy(dense), copy.deepcopy(dense)
    parallelize_block(ours, dist.group.WORLD, sequence_parallel=sequence_parallel)
    from torch.distributed.tensor.parallel import parallelize_module
    parallelize_module(theirs, ParallelMesh(tp=n).device_mesh["tp"], torch_block_plan(sequence_parallel))

    T = 8
    cos, sin = rope_tables(T, cfg.head_dim, cfg.rope_theta)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, T, cfg.d_model, dtype=torch.float64, generator=gen)
    w_out = torch.randn(2, T, cfg.d_model, dtype=torch.float64, generator=gen)
    if sequence_parallel:  # each rank holds its T/t tokens of the residual stream
        x, w_out = x.chunk(n, 1)[r], w_out.chunk(n, 1)[r]
    results = []
    for block in (ours, theirs):
        xi = x.clone().requires_grad_(True)
        y = block(xi, cos, sin)
        (y * w_out).sum().backward()
        results.append((y.detach(), xi.grad, _full_grads(block)))
    (y_ours, gx_ours, g_ours), (y_torch, gx_torch, g_torch) = results
    fails = []
    for what, a, e in [("output", y_ours, y_torch), ("input grad", gx_ours, gx_torch),
                       *[(f"{k} grad", g_ours[k], g_torch[k]) for k in g_torch]]:
        if a.shape != e.shape or not torch.allclose(a, e, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL):
            fails.append(f"rank {r} {what}: ours {tuple(a.shape)} vs torch {tuple(e.shape)}")
    return fails


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no_sp", "sequence_parallel"])
def test_tp_dtensor_block_matches_parallelize_module(sequence_parallel):
    for fails in run_on_ranks(dtensor_body, 2, sequence_parallel):
        assert not fails, "\n".join(fails)
