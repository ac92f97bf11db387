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
        batches = synthetic_regression_batches(num_batches=steps, batch_size=rows, dim=8, seed=seed)
        return MLPWithUnused(seed, dtype), [tuple(t.to(dtype) for t in b) for b in batches]
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
def train_fully_shard(kind, seed, steps, micro, accum, optimizer, impl="ours", mp=None, dtype=torch.float64,
                      record_grad_max=False):
    """The PyTorch way: wrap, build torch.optim on model.parameters(), loop (on every rank)."""
    model, batches = _setup(kind, seed, micro * accum * dist.get_world_size(), steps, dtype)
    if impl == "ours":
        fully_shard(model, mp_policy=MixedPrecisionPolicy(*mp) if mp else None)
    else:  # torch's FSDP2, the same units: each block, then the root
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        policy = TorchPolicy(*mp) if mp else TorchPolicy()
        for block in getattr(model, "blocks", []):
            torch_fully_shard(block, mp_policy=policy)
        torch_fully_shard(model, mp_policy=policy)
    grad_max = _record_grad_max(model) if record_grad_max else None
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
    params = {k: v.detach().double().cpu() for k, v in full.items()}
    return (losses, params, grad_max[0]) if record_grad_max else (losses, params)


def _record_grad_max(model):
    """Test instrumentation: the largest |element| of the local gradients handed to the reduce."""
    state, seen = model._fully_shard, [0.0]
    on_unit_grads = state.on_unit_grads

    def recording(u, grads):
        seen[0] = max([seen[0]] + [g.abs().max().item() for g in grads if g is not None])
        on_unit_grads(u, grads)
    state.on_unit_grads = recording
    return seen


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


# Where the reduction order agrees (two ranks: a + b = b + a, and / 2 is exact; or a float32
# reduce after identical low-precision backward passes), ours and FSDP2 agree bit for bit.
EXACT = [("gpt", 2, torch.float32, None), ("gpt", 2, torch.float32, (torch.bfloat16, None)),
         ("mlp", 2, torch.float32, (torch.float16, None)), ("gpt", 3, torch.float32, (torch.bfloat16, torch.float32))]


@pytest.mark.parametrize(("kind", "world", "dtype", "mp"), EXACT)
def test_fully_shard_agrees_with_torch_fsdp2_bit_for_bit(kind, world, dtype, mp):
    ours = run_on_ranks(train_fully_shard, world, kind, 3, 3, 1, 2, "adamw", "ours", mp, dtype)
    theirs = run_on_ranks(train_fully_shard, world, kind, 3, 3, 1, 2, "adamw", "torch", mp, dtype)
    for (_, a), (_, b) in zip(ours, theirs):
        assert a.keys() == b.keys()
        unequal = [k for k in b if not torch.equal(a[k], b[k])]
        assert not unequal, f"ours and FSDP2 differ in {unequal}"


def test_fully_shard_agrees_with_torch_fsdp2_float64():
    ours = run_on_ranks(train_fully_shard, 3, "gpt", 3, 3, 1, 2, "adamw", "ours")
    theirs = run_on_ranks(train_fully_shard, 3, "gpt", 3, 3, 1, 2, "adamw", "torch")
    for (_, a), (_, b) in zip(ours, theirs):
        assert_state_dicts_close(a, b, what="ours vs FSDP2 (float64: only the order of 3 addends differs)")


@pytest.mark.parametrize(("kind", "low"), [("gpt", torch.bfloat16), ("mlp", torch.float16)])
def test_fully_shard_agrees_with_torch_fsdp2_low_precision_reduce(kind, low):
    """Three ranks reducing in bf16 / fp16: the two sums may round differently. SGD, whose
    update is linear in the gradient, so the bound below carries over to the parameters."""
    mp = (low, None)  # reduce_dtype defaults to param_dtype
    ours = run_on_ranks(train_fully_shard, 3, kind, 3, 3, 1, 2, "sgd", "ours", mp, torch.float32, True)
    theirs = run_on_ranks(train_fully_shard, 3, kind, 3, 3, 1, 2, "sgd", "torch", mp, torch.float32)
    grad_max = max(g for _, _, g in ours)  # G: the largest local gradient element any rank sent
    # Tolerance from rounding (N = 3 ranks, u = unit roundoff of `low`, accum = 2 reductions a step):
    # a sum of N addends in any order is within (N - 1) u sum|g_r| <= (N - 1) u N G of the exact sum,
    # so two orders differ by <= 2 (N - 1) N u G, plus one rounding each of the division: 2 u G.
    # Per step: accum x that. SGD (lr, momentum 0.9) over 3 steps moves a parameter by lr x
    # (1 + 1.9 + 2.71) = 5.61 lr per unit of gradient error. Second-order effects (the weights
    # differing feed back through the next forward) are smaller by a factor ~lr and are neglected.
    n, u, lr = 3, torch.finfo(low).eps / 2, OPTIMIZERS["sgd"][1]["lr"]
    tol = 5.61 * lr * 2 * (2 * (n - 1) * n * u * grad_max + 2 * u * grad_max)
    for (_, a, _), (_, b) in zip(ours, theirs):
        worst = max((a[k] - b[k]).abs().max().item() for k in b)
        assert worst <= tol, f"ours vs FSDP2 in {low}: max |diff| {worst:.3e} > derived bound {tol:.3e}"


def test_fully_shard_grads_accumulate_and_unused_stay_none_in_one_process():
    """No process group (a group of one): the shards are the flattened parameters, their
    .grad the sum over backward calls, and a parameter no forward used keeps .grad None."""
    model, batches = _setup("mlp", 1, 4, 2)
    reference, _ = _setup("mlp", 1, 4, 2)
    fully_shard(model)
    shards = dict(model.named_parameters())
    assert all(s.dim() == 1 for s in shards.values()) and shards.keys() == dict(reference.named_parameters()).keys()
    for batch in batches:  # two backward calls, no zero_grad between them
        model(*batch).backward()
        reference(*batch).backward()
    for name, p in reference.named_parameters():
        if p.grad is None:  # the unused layer (and the frozen one): no gradient, as in torch
            assert shards[name].grad is None, name
        else:
            torch.testing.assert_close(shards[name].grad, p.grad.reshape(-1), rtol=0, atol=0)  # same ops: exact
    assert shards["unused.weight"].grad is None and shards["fc_in.weight"].grad is not None


def test_fully_shard_rejects_bad_input():
    model, _ = _setup("mlp", 0, 2, 1)
    with pytest.raises(ValueError, match="not sharded by tinyscale.zero.fully_shard"):
        full_parameters(model)
    fully_shard(model)
    with pytest.raises(ValueError, match="already sharded"):
        fully_shard(model)
    with pytest.raises(ValueError, match="has no parameters"):
        fully_shard(nn.ReLU())


def _ledger_one_step(kind):
    from tinyscale.dist import comm

    model, batches = _setup(kind, 0, dist.get_world_size(), 1)
    fully_shard(model)
    with comm.record() as ledger:
        model(*_local_rows(batches[0], 1, 1)[0]).backward()
    return ledger.calls("all_gather"), ledger.bytes("all_gather"), ledger.calls("reduce_scatter"), \
        ledger.bytes("reduce_scatter"), ledger.calls()


@pytest.mark.parametrize("world", [2, 3])
def test_fully_shard_communication_per_micro_batch_matches_the_count(world):
    """Per unit: an all-gather in forward and again in backward, then one reduce-scatter of
    the gradients plus one usage count per parameter (float64: 8 bytes an element)."""
    model, _ = _setup("gpt", 0, 1, 1)
    gathers, gather_bytes, reduces, reduce_bytes, calls = run_on_ranks(_ledger_one_step, world, "gpt")[0]
    blocks = [[p.numel() for p in block.parameters()] for block in model.blocks]
    units = blocks + [[p.numel() for n, p in model.named_parameters() if not n.startswith("blocks.")]]
    padded = [sum(-(-n // world) * world for n in unit) for unit in units]  # each parameter padded to N
    assert (gathers, reduces, calls) == (2 * len(units), len(units), 3 * len(units))
    assert gather_bytes == 2 * 8 * sum(padded)
    assert reduce_bytes == 8 * sum(pad + world * len(unit) for pad, unit in zip(padded, units))


def _train_rank_dependent_usage(api):
    """test_unused's UnusedMLP and batches: `extra` is used on one rank, in one micro-batch,
    on every rank or nowhere, step by step; `unused` never. AdamW with weight decay 0.1."""
    from tests.zero.test_unused import ACCUM, MICRO, UnusedMLP, batches
    from tinyscale.zero import ZeroOptimizer

    model = UnusedMLP()
    kwargs = {"lr": 1e-2, "weight_decay": 0.1}
    if api == "fully_shard":
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), **kwargs)
    else:
        opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, reduce_grads=True, stage=int(api[-1]), **kwargs)
    for batch in batches():
        for x, y in _local_rows(batch, MICRO, ACCUM):
            (model(x, y) / ACCUM).backward()
        opt.step()
        opt.zero_grad()
    full = full_parameters(model) if api == "fully_shard" else dict(model.named_parameters())
    return {k: v.detach().clone() for k, v in full.items()}


@pytest.mark.parametrize("api", ["fully_shard", "zero_optimizer_api-stage1", "zero_optimizer_api-stage2"])
def test_fully_shard_and_zero_optimizer_api_with_rank_dependent_usage_match_single_process(api):
    """A parameter used on some ranks only contributes zero there; one used nowhere is not
    stepped (no decay): float64, 3 ranks, equal to one process (test_unused's reference)."""
    from tests.zero.test_unused import USES_EXTRA, WORLD
    from tests.zero.test_unused import reference as unused_reference

    _, expected, _ = unused_reference(len(USES_EXTRA))
    for params in run_on_ranks(_train_rank_dependent_usage, WORLD, api):
        assert_state_dicts_close(params, {k: v for k, v in expected.items() if k in params},
                                 what=f"{api} with rank-dependent usage vs one process")
