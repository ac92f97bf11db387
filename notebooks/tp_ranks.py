"""Rank functions for notebooks/07-tensor-parallel.ipynb (lesson 7, "Tensor parallelism").

`tinyscale.dist.launch` starts every rank as a fresh process, which finds a function only by
importing it, so everything that runs on ranks lives here, at module level. Each function runs
on every rank of the launch (the whole world is one tensor-parallel group) with the same
arguments; `launch` returns the values in rank order. What they measure:

- `ledger`: the comm ledger of one forward and one backward of the split GPT (calls and bytes
  per collective), with or without sequence parallelism;
- `saved_per_block`: the bytes autograd saves for backward per transformer block on this rank
  (activation memory), with or without sequence parallelism;
- `loss_memory`: the bytes the vocab-parallel loss saves for backward, and its peak, on this rank;
- `train`: three training steps of the split GPT with `tinyscale.reference.train`'s loop, the
  losses and the gathered parameters (to compare with one process).

`run_many` runs several of them in one launch (starting ranks costs seconds).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import tinyscale as ts
from tinyscale.checkpointing.measure import peak_bytes, saved_bytes
from tinyscale.data import synthetic_token_batches
from tinyscale.dist import comm
from tinyscale.models import GPT, GPTConfig
from tinyscale.tensor_parallel import apply_tensor_parallel, full_state_dict_from_tp, vocab_parallel_cross_entropy

VOCAB, B, T = 251, 4, 32  # a prime vocab: padded on every degree
SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}


def config(n_layer: int = 2, tied: bool = False) -> GPTConfig:
    """8 query heads and 4 K/V heads (GQA): splits over 1, 2 and 4 ranks."""
    return GPTConfig(vocab_size=VOCAB, max_seq_len=T, n_layer=n_layer, n_head=8, n_kv_head=4, d_model=64,
                     ffn_hidden=128, tie_embeddings=tied)


def batches(steps: int):
    return synthetic_token_batches(num_batches=steps, batch_size=B, seq_len=T, vocab_size=VOCAB, seed=3)


def split_model(n_layer: int, sequence_parallel: bool, tied: bool = False) -> GPT:
    """The same full float64 GPT on every rank, split over the world in place (tp = 1: unsplit)."""
    model = GPT(config(n_layer, tied), seed=5, dtype=torch.float64)
    if dist.is_initialized():
        apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=sequence_parallel)
    return model


def ledger(sequence_parallel: bool, n_layer: int) -> list[dict]:
    """[forward, backward]: {op: (calls, bytes)} of one micro-batch."""
    model = split_model(n_layer, sequence_parallel)
    idx, targets = batches(1)[0]
    with comm.record() as forward:
        loss = model(idx, targets)
    with comm.record() as backward:
        loss.backward()
    return [{op: (led.calls(op), led.bytes(op)) for op in ("all_reduce", "all_gather", "reduce_scatter")}
            for led in (forward, backward)]


def saved_per_block(sequence_parallel: bool) -> int:
    """Activation bytes one block adds on this rank: saved bytes with 2 blocks minus with 1."""
    idx, targets = batches(1)[0]
    total = {}
    for n_layer in (1, 2):
        model = split_model(n_layer, sequence_parallel)
        total[n_layer] = saved_bytes(model, idx, targets)
    return total[2] - total[1]


def loss_memory(vocab: int, tokens: int) -> dict:
    """The vocab-parallel loss on this rank's columns of (tokens, vocab) logits: the bytes it
    saves for backward, and the peak bytes of its forward and backward."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    local = -(-vocab // tp)  # ceil(V/t) columns per rank (the last rank's tail is padding)
    gen = torch.Generator().manual_seed(rank)
    logits = torch.randn(tokens, local, generator=gen, requires_grad=True)  # float32
    targets = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0))

    def loss():
        return vocab_parallel_cross_entropy(logits, targets, dist.group.WORLD, vocab_size=vocab).mean()

    return {"local_columns": local, "saved": saved_bytes(loss),
            "peak": peak_bytes(lambda: loss().backward())}


def train(sequence_parallel: bool, steps: int = 3, tied: bool = True):
    """The split GPT trained like one process (the loop of reference.train, float64, SGD)."""
    model = split_model(2, sequence_parallel, tied)
    cfg = {"train_batch_size": B, "train_micro_batch_size_per_gpu": B, "optimizer": SGD}
    losses = ts.reference.train(model, batches(steps), cfg)
    return losses, full_state_dict_from_tp(model)


def run_many(calls: list[tuple[str, tuple]]) -> list:
    """Run several of this module's functions in one launch: [(name, args)] -> [result]."""
    return [globals()[name](*args) for name, args in calls]
