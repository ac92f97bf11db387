"""Tensor parallelism (Megatron-LM), sequence parallelism, vocab-parallel embedding and loss.

Each weight matrix of a layer is split over the ranks of a tensor-parallel (TP) group, so each
rank stores and multiplies 1/t of it; activations are exchanged inside every layer instead.

    comm_ops.py       the conjugate operators f and g (and the sequence-parallel all-gather /
                      reduce-scatter) as autograd functions, all through the comm ledger
    layers.py         ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                      SequenceParallelRMSNorm, each built from the full layer
    cross_entropy.py  vocab_parallel_cross_entropy: the loss without gathering the logits
    kv_heads.py       ReplicatedKVLinear: K/V heads copied when n_kv_head divides t
    random.py         dropout: Megatron's RNG tracker, or exact_dropout (one process's masks)
    apply.py          apply_tensor_parallel(gpt, mesh_or_group, sequence_parallel=...) in place,
                      full_state_dict_from_tp(model) its inverse
    auto.py           AutoTP: find_plan(model, tp, tp_plan) and apply_autotp(model, group, plan)
                      split a model tinyscale did not write (a transformers Llama), by name
    fused.py          FusedColumnLinear (fused q/k/v split chunk by chunk), RowParallelConv1D:
                      transformers' Conv1D layers (GPT-2) in their own (in, out) layout

    model = GPT(cfg, seed=0)                      # the same full model on every rank
    apply_tensor_parallel(model, ParallelMesh(tp=2), sequence_parallel=True)
    loss = model(idx, targets)                    # the same loss on every rank of the group

Papers: Shoeybi et al. 2019 (Megatron-LM, sec. 3); Korthikanti et al. 2022 (sequence
parallelism, sec. 4.2.2). Tests: `pytest tests/tensor_parallel` (keys tp, sp, vocab_parallel).
"""

from tinyscale.tensor_parallel.apply import (
    TensorParallelGPT,
    apply_tensor_parallel,
    check_tensor_parallel,
    full_state_dict_from_tp,
    parallelize_block,
)
from tinyscale.tensor_parallel.auto import apply_autotp, find_plan
from tinyscale.tensor_parallel.comm_ops import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_region,
    split_to_sequence,
)
from tinyscale.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tinyscale.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelRMSNorm,
    VocabParallelEmbedding,
    padded_size,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "SequenceParallelRMSNorm",
    "TensorParallelGPT",
    "VocabParallelEmbedding",
    "apply_autotp",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "copy_to_region",
    "find_plan",
    "full_state_dict_from_tp",
    "gather_from_region",
    "gather_from_sequence",
    "padded_size",
    "parallelize_block",
    "reduce_from_region",
    "reduce_scatter_to_sequence",
    "scatter_to_region",
    "split_to_sequence",
    "vocab_parallel_cross_entropy",
]
