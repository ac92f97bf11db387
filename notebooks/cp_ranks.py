"""Rank functions for notebooks/09-context-parallel.ipynb (lesson 9, "Context parallelism").

`tinyscale.dist.launch` starts every rank as a fresh process, which finds a function only
by importing it, so everything that runs on ranks lives here, at module level. Each function
runs on every rank with the same arguments; `launch` returns the values in rank order.

- `ledger`: ring and Ulysses attention, forward and backward, on this rank's shard; the bytes
  each put on the wire (the comm ledger), per op;
- `rope_check`: the GPT's shard logits against the full model's, with RoPE at the global
  positions (what `apply_context_parallel` does) and at local ones (the wrong answer);
- `torch_context_parallel`: PyTorch's `context_parallel` on this CPU/gloo run (what happens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tinyscale.context_parallel import apply_context_parallel, ring_attention, ulysses_attention
from tinyscale.context_parallel.sharding import Layout, shard, unshard
from tinyscale.dist import comm
from tinyscale.models import GPT, GPTConfig


def run_many(calls: list[tuple[str, tuple]]) -> list:
    """Run several of this module's functions in one launch: [(name, args)] -> [result]."""
    return [globals()[name](*args) for name, args in calls]


def _problem(B, T, H, K, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=g, dtype=dtype), torch.randn(B, K, T, D, generator=g, dtype=dtype),
            torch.randn(B, K, T, D, generator=g, dtype=dtype))


def _subgroup(cp: int):
    """The group of `cp` consecutive ranks this rank is in (every rank creates every group)."""
    world = dist.get_world_size()
    if world % cp:
        raise ValueError(f"cp={cp} does not divide the {world} ranks of this launch")
    groups = [dist.new_group(list(range(s, s + cp))) for s in range(0, world, cp)]
    return groups[dist.get_rank() // cp]


def ledger(cp: int, B: int, T: int, H: int, K: int, D: int, sharding: str = "zigzag") -> dict:
    """{algorithm: {"forward": by_op, "backward": by_op}} for one attention layer on this rank,
    in a group of `cp` consecutive ranks."""
    group = _subgroup(cp)
    rank = dist.get_rank(group)
    layout = Layout(cp, sharding, T)
    rows = {}
    for algorithm in ("ring", "ulysses"):
        if algorithm == "ulysses" and H % cp:
            continue  # Ulysses refuses: the lesson shows the error
        q, k, v = (shard(t, layout, rank, dim=2).requires_grad_() for t in _problem(B, T, H, K, D))
        with comm.record() as fwd:
            if algorithm == "ring":
                out = ring_attention(q, k, v, group, layout=layout, causal=True)[0]
            else:
                out = ulysses_attention(q, k, v, group, layout=layout, causal=True)
        with comm.record() as bwd:
            out.sum().backward()
        rows[algorithm] = {"forward": fwd.by_op(), "backward": bwd.by_op()}
    return rows


CFG = GPTConfig(vocab_size=64, max_seq_len=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32, ffn_hidden=64)


def rope_check(algorithm: str, sharding: str, T: int = 32) -> dict:
    """Max |shard logits - full logits| with RoPE at global positions, and at local ones."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    full = GPT(CFG, seed=0, dtype=torch.float64)
    idx = torch.randint(0, CFG.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    want = full(idx)  # (2, T, V): one process, the whole row
    model = apply_context_parallel(GPT(CFG, seed=0, dtype=torch.float64), None, algorithm=algorithm,
                                   sharding=sharding)
    layout = Layout(cp, sharding, T)
    mine = shard(idx, layout, rank)
    errors = {}
    for name in ("global positions", "local positions"):
        if name == "local positions":  # the wrong answer: every shard rotated as if it started at 0
            cos, sin = model.rope_cos.clone(), model.rope_sin.clone()
            starts = layout.positions(rank)
            model.rope_cos[starts], model.rope_sin[starts] = cos[: layout.local_len], sin[: layout.local_len]
        with torch.no_grad():
            logits = model(mine)  # (2, Tl, V)
        pieces = [torch.empty_like(logits) for _ in range(cp)]
        dist.all_gather(pieces, logits)
        errors[name] = (unshard(pieces, layout) - want).abs().max().item()
    return errors


def torch_context_parallel(T: int = 16) -> str:
    """PyTorch's own context parallel on this run's device and backend: the result or the error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    q, k, v = _problem(1, T, 2, 2, 8)
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except Exception as exc:  # noqa: BLE001 - the notebook prints whatever torch raises
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return f"ran: out {tuple(out.shape)}"
