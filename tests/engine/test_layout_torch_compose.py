"""The engine's dp x tp layout agrees with the same layout composed from PyTorch's own pieces.

PyTorch's: DTensor tensor parallelism on each block (`parallelize_module`, torchtitan's plan),
then FSDP2 `fully_shard` over the dp axis of the same device mesh (`tinyscale.engine.torch_compose`).
Ours: `parallel.tensor` 2 with `zero_optimization.stage` 3 over dp. Same GPT (GQA, float64), same
AdamW with weight decay, same batches: the losses of 3 steps and the parameters after them agree at
rtol 1e-10 (float64: reduction order is the only difference, ~1e-15 per op). Also tp 2 alone
(DTensor TP, no FSDP) against our TP at ZeRO 0. And dp 2 x pp 2: torch's `Schedule1F1B` over
`PipelineStage(GPTStage)` with FSDP2 over dp (`torch_pipelined_gpt`) against the engine's 1f1b
pipeline at ZeRO 3 (FSDP2 resharding after forward) and ZeRO 0 (FSDP2 kept gathered), an untied
GQA GPT of 3 blocks (stages of 1 and 2), 2 micro-batches per dp rank; pp 2 x tp 2 with the
stages' blocks DTensor-split too; and, under --thorough (8 ranks), dp 2 x pp 2 x tp 2 at ZeRO 3:
losses and each stage's parameters, gathered over dp and tp, at rtol 1e-10.
Run: `pytest tests/engine/test_layout_torch_compose.py` (key layout_torch).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.data import synthetic_token_batches
from tinyscale.dist import ParallelMesh
from tinyscale.engine.torch_compose import full_state, pipelined_step, torch_composed_gpt, torch_pipelined_gpt
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks

VOCAB, SEQ, STEPS, ROWS = 40, 8, 3, 2
ADAMW = {"lr": 1e-2, "weight_decay": 0.1}


def gpt(n_layer: int = 2) -> GPT:
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=n_layer, n_head=4, n_kv_head=2, d_model=16,
                    ffn_hidden=24, tie_embeddings=False)  # torchtitan's Llama does not tie either
    return GPT(cfg, seed=3, dtype=torch.float64)


def _both(dp: int, tp: int, stage: int):
    batches = synthetic_token_batches(num_batches=STEPS, batch_size=ROWS * dp, seq_len=SEQ, vocab_size=VOCAB, seed=2)
    engine = ts.initialize(gpt(), {"train_batch_size": ROWS * dp, "train_micro_batch_size_per_gpu": ROWS,
                                   "optimizer": {"type": "AdamW", "params": ADAMW},
                                   "zero_optimization": {"stage": stage}, "parallel": {"tensor": tp}})
    ours = [engine.train_batch(b) for b in batches]
    ours_state = engine.full_state_dict()

    mesh = ParallelMesh(dp=dp, tp=tp)
    model = torch_composed_gpt(gpt(), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    theirs = []
    for ids, targets in batches:
        rows = slice(mesh.rank("dp") * ROWS, (mesh.rank("dp") + 1) * ROWS)  # this dp rank's rows
        loss = model(ids[rows], targets[rows])
        loss.backward()  # FSDP2 averages the gradients over dp; TP's are whole after its all-reduces
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(mean, group=mesh.group("dp"))
        theirs.append(mean.item() / dp)
    return ours, ours_state, theirs, full_state(model)


@functools.cache
def results(dp: int, tp: int, stage: int) -> list:
    return run_on_ranks(_both, dp * tp, dp, tp, stage)


@pytest.mark.parametrize("dp, tp, stage", [(1, 2, 0), (2, 2, 3)], ids=["tp2-dtensor", "dp2-tp2-zero3-fsdp2"])
def test_layout_torch_dtensor_fsdp2_agree_with_engine(dp, tp, stage):
    for rank, (ours, ours_state, theirs, theirs_state) in enumerate(results(dp, tp, stage)):
        assert_losses_close(ours, theirs)
        assert_state_dicts_close(ours_state, theirs_state, what=f"rank {rank}: engine vs torch's dp {dp} x tp {tp}")


M = 2  # micro-batches per dp rank: its ROWS rows, one row each (torch's schedule splits them the same way)


def _both_pipelined(dp: int, pp: int, stage: int, reshard: bool, tp: int = 1):
    """Engine dp x pp (1F1B, ZeRO `stage`) and torch's Schedule1F1B over FSDP2, the same batches."""
    batches = synthetic_token_batches(num_batches=STEPS, batch_size=ROWS * dp, seq_len=SEQ, vocab_size=VOCAB, seed=2)
    engine = ts.initialize(gpt(3), {"train_batch_size": ROWS * dp, "train_micro_batch_size_per_gpu": ROWS // M,
                                   "gradient_accumulation_steps": M,
                                   "optimizer": {"type": "AdamW", "params": ADAMW},
                                   "zero_optimization": {"stage": stage},
                                   "parallel": {"pipeline": pp, "pipeline_schedule": "1f1b", "tensor": tp}})
    ours = [engine.train_batch(b) for b in batches]
    ours_state = engine.full_state_dict()

    mesh = ParallelMesh(dp=dp, pp=pp, tp=tp)
    model = gpt(3)  # 3 blocks: the 2 stages hold 1 and 2 (the engine's cut, `partition_gpt`)
    schedule, stage_module = torch_pipelined_gpt(model, mesh, M, reshard_after_forward=reshard)
    optimizer = torch.optim.AdamW(stage_module.parameters(), **ADAMW)
    rows = slice(mesh.rank("dp") * ROWS, (mesh.rank("dp") + 1) * ROWS)  # this dp rank's rows, as the engine's
    theirs = []
    for ids, targets in batches:
        theirs.append(pipelined_step(schedule, mesh, ids[rows], targets[rows]).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    mine = {id(q) for q in stage_module.parameters()}  # this pp rank's stage: compared against the engine's
    theirs_state = {k: (q.full_tensor() if hasattr(q, "full_tensor") else q).detach().clone()
                    for k, q in model.named_parameters() if id(q) in mine}
    return ours, {k: ours_state[k] for k in theirs_state}, theirs, theirs_state, set(ours_state)


@functools.cache
def pipelined_results() -> list[dict]:
    """One pooled 4-rank call: dp 2 x pp 2, ZeRO 3 against FSDP2, ZeRO 0 against FSDP2 kept gathered;
    pp 2 x tp 2 against DTensor TP inside torch's stages."""
    return run_on_ranks(_pooled, 4)


def _pooled():
    return {"dp2-pp2-zero3-fsdp2": _both_pipelined(2, 2, 3, True),
            "dp2-pp2-zero0-fsdp2-no-reshard": _both_pipelined(2, 2, 0, False),
            "pp2-tp2-dtensor": _both_pipelined(1, 2, 0, True, tp=2)}


@pytest.mark.parametrize("case", ["dp2-pp2-zero3-fsdp2", "dp2-pp2-zero0-fsdp2-no-reshard", "pp2-tp2-dtensor"])
def test_layout_torch_pipelining_agrees_with_engine(case):
    compared = set()
    for rank, per_rank in enumerate(pipelined_results()):
        ours, ours_state, theirs, theirs_state, every_key = per_rank[case]
        compared |= set(theirs_state)
        assert_losses_close(ours, theirs)
        assert_state_dicts_close(ours_state, theirs_state, what=f"rank {rank}: engine vs torch's pipeline ({case})")
    assert compared == every_key  # the two stages together: every parameter of the GPT


@pytest.mark.thorough  # 8 ranks on the 2 CPU cores cost more than the default suite's share
def test_layout_torch_pipelining_dp2_pp2_tp2_zero3_agrees_with_engine():
    compared = set()
    for rank, (ours, ours_state, theirs, theirs_state, every_key) in enumerate(
            run_on_ranks(_both_pipelined, 8, 2, 2, 3, True, 2)):
        compared |= set(theirs_state)
        assert_losses_close(ours, theirs)
        assert_state_dicts_close(ours_state, theirs_state, what=f"rank {rank}: engine vs torch's dp 2 x pp 2 x tp 2")
    assert compared == every_key
