"""Property: for any GPT shape that tensor parallelism can split, one forward and backward of the
split model equal the dense model's (loss and every gathered gradient, float64, rtol 1e-10).

Hypothesis draws the degree (2, 3, 4), heads and K/V heads per rank (GQA or not), head sizes,
FFN widths, vocab sizes from 2 up (mostly not divisible: padding, even whole ranks of padding
when V < t), layer counts, tied or untied head, sequence parallelism on or off, batch rows and
sequence lengths. `--thorough` draws 100 examples instead of 8.
Run: `pytest tests/tensor_parallel -k tp_property`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from tinyscale.models import GPT, GPTConfig
from tinyscale.tensor_parallel import apply_tensor_parallel
from tinyscale.testing import FLOAT64_ATOL, FLOAT64_RTOL, run_on_ranks


@st.composite
def tp_layouts(draw):
    tp = draw(st.sampled_from([2, 3, 4]))
    heads_per_rank = draw(st.sampled_from([1, 2]))
    kv_per_rank = draw(st.sampled_from([k for k in (1, 2) if heads_per_rank % k == 0]))
    head_dim = draw(st.sampled_from([2, 4, 6]))
    sequence_parallel = draw(st.booleans())
    seq_len = tp * draw(st.integers(1, 3)) if sequence_parallel else draw(st.integers(1, 7))
    config = dict(vocab_size=draw(st.integers(2, 40)), max_seq_len=12, n_layer=draw(st.integers(1, 2)),
                  n_head=tp * heads_per_rank, n_kv_head=tp * kv_per_rank, d_model=tp * heads_per_rank * head_dim,
                  ffn_hidden=tp * draw(st.integers(1, 4)), tie_embeddings=draw(st.booleans()))
    return tp, config, sequence_parallel, draw(st.integers(1, 3)), seq_len, draw(st.integers(0, 2**16))


def property_body(config: dict, sequence_parallel: bool, rows: int, seq_len: int, seed: int):
    cfg = GPTConfig(**config)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (rows, seq_len), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (rows, seq_len), generator=gen)
    dense = GPT(cfg, seed=seed, dtype=torch.float64)
    dense_loss = dense(idx, targets)
    dense_loss.backward()
    model = GPT(cfg, seed=seed, dtype=torch.float64)
    apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=sequence_parallel)
    loss = model(idx, targets)
    loss.backward()
    fails = []
    if not torch.allclose(loss, dense_loss, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL):
        fails.append(f"loss {loss.item()!r} != dense {dense_loss.item()!r}")
    expected = dict(dense.named_parameters())
    for name, p in model.named_parameters():
        path, _, leaf = name.rpartition(".")
        owner = model.get_submodule(path)
        grad = owner.full_tensor(leaf, p.grad) if hasattr(owner, "full_tensor") else p.grad
        want = expected[name].grad
        if grad.shape != want.shape or not torch.allclose(grad, want, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL):
            fails.append(f"rank {dist.get_rank()}: grad of {name} differs")
    return fails


@given(tp_layouts())
def test_tp_property_gpt_forward_backward_matches_dense(layout):
    tp, config, sequence_parallel, rows, seq_len, seed = layout
    for fails in run_on_ranks(property_body, tp, config, sequence_parallel, rows, seq_len, seed):
        assert not fails, f"{layout}: " + "\n".join(fails)
