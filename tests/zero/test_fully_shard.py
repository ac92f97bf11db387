"""ZeRO-3 the PyTorch way (`tinyscale.zero.fully_shard`): wrap, then torch.optim on the shards.
The same training as one process (float64) and as torch's FSDP2 `fully_shard` (float64,
fp32, bf16, fp16), with tied weights, a frozen and an unused parameter, world sizes 2 and 3.
Run: `pytest -k fully_shard`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tinyscale as ts
from tinyscale.data import synthetic_regression_batches, synthetic_token_batches
from tinyscale.models import GPT, GPTConfig, TinyMLP
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks
from tinyscale.zero import MixedPrecisionPolicy, full_parameters, fully_shard

OPTIMIZERS = {  # SGD too: Adam hides a uniform gradient-scale bug
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.05}),
    "sgd": (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9, "weight_decay": 0.01}),
}
CONFIG_NAMES = {"adamw": "AdamW", "sgd": "SGD"}


class MLPWithUnused(TinyMLP):
    """TinyMLP (tied fc_in, frozen layer) plus a layer no forward uses: its .grad stays None."""

    def __init__(self, seed: int, dtype=torch.float64):
        super().__init__(seed=seed, dtype=dtype)
        self.unused = nn.Linear(3, 2, dtype=dtype)
        with torch.no_grad():
            self.unused.weight.fill_(0.5)
            self.unused.bias.fill_(0.25)  # nonzero: weight decay would move them


def _setup(kind, seed, rows, steps, dtype=torch.float64):
    if kind == "mlp":
        model = MLPWithUnused(seed, dtype)
        return model, synthetic_regression_batches(num_batches=steps, batch_size=rows, dim=8, seed=seed)
    # d_model 20, 5 heads: sizes that divide neither 2 nor 3 (padding); tied head and embedding
    cfg = GPTConfig(vocab_size=256, max_seq_len=16, n_layer=2, n_head=5, d_model=20, ffn_hidden=36, tie_embeddings=True)
    return GPT(cfg, seed=seed, dtype=dtype), synthetic_token_batches(num_batches=steps, batch_size=rows, seq_len=16,
                                                                     seed=seed)


def _local_rows(batch, micro, accum):
    """This rank's rows of a global batch (contiguous), cut into `accum` micro-batches."""
    rank, rows = dist.get_rank(), micro * accum
    mine = [t[rank * rows:(rank + 1) * rows] for t in batch]
    return [tuple(t[i * micro:(i + 1) * micro] for t in mine) for i in range(accum)]


# --8<-- [start:pytorch-way]
def train_fully_shard(kind, seed, steps, micro, accum, optimizer, impl="ours", mp=None):
    """The PyTorch way: wrap, build torch.optim on model.parameters(), loop (on every rank)."""
    model, batches = _setup(kind, seed, micro * accum * dist.get_world_size(), steps)
    if impl == "ours":
        fully_shard(model, mp_policy=MixedPrecisionPolicy(*mp) if mp else None)
    else:  # torch's FSDP2, the same units: each block, then the root
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        policy = TorchPolicy(*mp) if mp else TorchPolicy()
        for block in getattr(model, "blocks", []):
            torch_fully_shard(block, mp_policy=policy)
        torch_fully_shard(model, mp_policy=policy)
    opt_class, kwargs = OPTIMIZERS[optimizer]
    opt = opt_class(model.parameters(), **kwargs)
    losses = []
    for batch in batches:
        total = 0.0
        for x, y in _local_rows(batch, micro, accum):
            loss = model(x, y)
            (loss / accum).backward()  # gradients accumulate in the shards' .grad
            total += loss.item() / accum
        opt.step()
        opt.zero_grad()
        losses.append(total)
    # --8<-- [end:pytorch-way]
    if impl == "ours":
        full = full_parameters(model)
    else:
        full = {k: v.full_tensor() for k, v in model.named_parameters()}
    return losses, {k: v.detach().double().cpu() for k, v in full.items()}


def _reference(kind, seed, steps, micro, accum, world, optimizer):
    opt_class, kwargs = OPTIMIZERS[optimizer]
    config = {"train_batch_size": micro * accum * world, "train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": accum,
              "optimizer": {"type": CONFIG_NAMES[optimizer], "params": kwargs}}
    model, batches = _setup(kind, seed, micro * accum * world, steps)
    losses = ts.reference.train(model, batches, config)
    return losses, {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize(("kind", "world", "optimizer"), [("mlp", 2, "adamw"), ("mlp", 3, "sgd"),
                                                           ("gpt", 3, "adamw"), ("gpt", 2, "sgd")])
def test_fully_shard_matches_single_process_float64(kind, world, optimizer):
    """Tied weights, a frozen layer and an unused layer (mlp), uneven shards, accumulation."""
    results = run_on_ranks(train_fully_shard, world, kind, 7, 3, 1, 2, optimizer)
    expected_losses, expected = _reference(kind, 7, 3, 1, 2, world, optimizer)
    for _, params in results:
        assert_state_dicts_close(params, expected, what="fully_shard vs one process")
    # each rank's loss is its rows' mean; equal row counts, so their mean is the global mean
    assert_losses_close([sum(step) / world for step in zip(*(losses for losses, _ in results))], expected_losses)
