"""The MoE layer in one process: router, capacity, the per-token sum, the aux losses, the GPT.

Run: `pytest tests/moe/test_moe.py` (key moe). Float64 throughout: the layer against a loop
over tokens written from the definitions must agree to rounding (rtol 1e-12: a few float64
ulps of O(1) sums of at most 4 products; a wrong weight, expert or drop is off by O(1e-2)).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import tinyscale as ts
from tinyscale.models import GPT, GPTConfig
from tinyscale.moe import MoE, capacity, moe_layers, moe_stats, route

TINY = GPTConfig.preset("tiny")


def _layer(E=5, k=2, cf=0.8, kind="softmax", shared=0, seed=0, hidden=None) -> MoE:
    cfg = TINY.with_(moe_experts=E, moe_top_k=k, moe_capacity_factor=cf, moe_router=kind, moe_shared_experts=shared,
                     moe_ffn_hidden=hidden)
    layer = MoE(cfg, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    return layer


def _per_token(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """y_t = sum over t's kept choices of w * expert(x_t), written token by token from the definitions."""
    N, E, k = x.shape[0], layer.num_experts, layer.top_k
    logits = x @ layer.router.weight.t()
    if layer.router_kind == "softmax":
        scores = logits.softmax(-1)
        w, e = scores.topk(k, -1)
        w = w / w.sum(-1, keepdim=True) if k > 1 else w
    else:
        s = logits.sigmoid()
        w, e = s.topk(k, -1)
        w = w / w.sum(-1, keepdim=True)
    cap = math.ceil(layer.capacity_factor * N * k / E) if layer.capacity_factor else N * k
    taken, y, dropped = [0] * E, torch.zeros_like(x), 0
    ex = layer.experts
    for j in range(k):  # every token's first choice before any second choice
        for t in range(N):
            i = int(e[t, j])
            if taken[i] >= cap:
                dropped += 1
                continue
            taken[i] += 1
            h = F.silu(x[t] @ ex.w_gate[i]) * (x[t] @ ex.w_up[i])
            y[t] += w[t, j] * (h @ ex.w_down[i])
    if layer.shared is not None:
        s = layer.shared
        y = y + s["w_down"](F.silu(s["w_gate"](x)) * s["w_up"](x))
    return y, dropped


@pytest.mark.parametrize("k,cf,kind,shared", [(1, 0.7, "softmax", 0), (2, 0.8, "softmax", 1), (2, None, "sigmoid", 0),
                                              (3, 1.1, "sigmoid", 0)])
def test_moe_layer_equals_the_per_token_sum_with_drops(k, cf, kind, shared):
    layer = _layer(E=5, k=k, cf=cf, kind=kind, shared=shared)
    x = torch.randn(2, 11, TINY.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = layer(x)
    want, dropped = _per_token(layer, x.reshape(22, -1))
    torch.testing.assert_close(y.reshape(22, -1), want, rtol=1e-12, atol=1e-12)
    assert layer.stats.dropped == dropped
    assert (dropped > 0) == (cf is not None), "every capacity here drops some assignments"
    assert int(layer.stats.load.sum()) == 22 * k


def test_moe_router_capacity_keeps_first_choices_first():
    # 4 tokens all prefer expert 0 then expert 1; capacity ceil(0.5 * 4 * 2 / 2) = 2 per expert
    logits = torch.tensor([[2.0, 1.0]] * 4, dtype=torch.float64)
    r = route(logits, top_k=2, capacity_factor=0.5)
    assert capacity(4, 2, 2, 0.5) == 2 and r.dropped == 4
    assert r.token_index.tolist() == [0, 1, 0, 1] and r.expert_index.tolist() == [0, 0, 1, 1]
    assert r.counts.tolist() == [2, 2] and r.load.tolist() == [4, 4]


def test_moe_aux_loss_is_alpha_at_uniform_routing_and_its_gradient_reaches_the_router():
    layer = _layer(E=4, k=1, cf=None)
    layer.z_loss_coef = 0.0
    with torch.no_grad():
        layer.router.weight.zero_()  # uniform probabilities; top-1 ties break to one expert
    x = torch.randn(1, 8, TINY.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    layer(x)
    # f = (1, 0, 0, 0), P = 1/4 each: L = alpha E sum f P = alpha
    assert layer.aux_loss.item() == pytest.approx(layer.aux_loss_coef, rel=1e-12)
    layer.router.weight.data.normal_(0, 1.0, generator=torch.Generator().manual_seed(3))
    layer(x)
    layer.aux_loss.backward()
    g = layer.router.weight.grad
    assert g is not None and g.abs().max() > 1e-6, "the aux loss must train the router (through P)"
    # from the definition: d/dW of alpha E sum_i f_i mean_t softmax(x W^T)_ti, f held fixed
    W = layer.router.weight.detach().clone().requires_grad_(True)
    tokens = x.reshape(8, -1)
    f = layer.stats.load.double() / 8
    (layer.aux_loss_coef * 4 * (f * (tokens @ W.t()).softmax(-1).mean(0)).sum()).backward()
    torch.testing.assert_close(g, W.grad, rtol=1e-12, atol=1e-15)


def test_moe_z_loss_is_the_mean_squared_logsumexp():
    logits = torch.randn(6, 3, dtype=torch.float64)
    r = route(logits, 1, z_loss_coef=0.5)
    assert r.z_loss.item() == pytest.approx(0.5 * (torch.logsumexp(logits, -1) ** 2).mean().item(), rel=1e-12)


def test_moe_gpt_param_count_keys_and_dense_blocks():
    cfg = TINY.with_(n_layer=3, moe_experts=3, moe_top_k=1, moe_layers=(0, 2), moe_shared_experts=1)
    model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert len(moe_layers(model)) == 2 and not hasattr(model.blocks[1].mlp, "router")
    assert model.state_dict()["blocks.0.mlp.experts.w_gate"].shape == (3, cfg.d_model, cfg.ffn_dim)
    assert TINY.num_params() == GPTConfig.preset("tiny").with_(moe_experts=0).num_params()


def test_moe_gpt_trains_in_the_reference_with_aux_in_its_loss():
    cfg = TINY.with_(moe_experts=4, moe_top_k=2, moe_capacity_factor=1.0)
    model = GPT(cfg, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 256, (4, 16), generator=gen), torch.randint(0, 256, (4, 16), generator=gen)
    ce = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
    loss = model(x, y)
    aux = sum(m.aux_loss for m in moe_layers(model))
    assert loss.item() == pytest.approx((ce + aux).item(), rel=1e-14) and aux.item() > 0
    losses = ts.reference.train(model, [(x, y)] * 3, {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                                                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    assert losses[-1] < losses[0]
    stats = moe_stats(model)
    assert stats["assignments"] == 2 * 2 * 16 * 2 and stats["aux_loss"] > 0


def _train_skewed(alpha: float, steps: int = 20) -> list[float]:
    """A layer whose router sends nearly every token to expert 0 (inputs share a direction that
    row 0 of the router is aligned with), trained on a regression + its aux loss; the load's
    coefficient of variation (std / mean over experts) at every step."""
    layer = _layer(E=4, k=1, cf=None, seed=0)
    layer.aux_loss_coef, layer.z_loss_coef = alpha, 0.0
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.1)
        layer.router.weight[0] += 0.3
    x = torch.randn(1, 128, TINY.d_model, generator=gen, dtype=torch.float64) + 0.5
    target = torch.randn(1, 128, TINY.d_model, generator=gen, dtype=torch.float64) * 0.1
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    cvs = []
    for _ in range(steps):
        loss = (layer(x) - target).pow(2).mean() + layer.aux_loss
        load = layer.stats.load.double()
        cvs.append((load.std(unbiased=False) / load.mean()).item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return cvs


def test_moe_aux_loss_makes_a_skewed_load_uniform():
    with_aux, without = _train_skewed(0.1), _train_skewed(0.0)
    assert with_aux[0] == without[0] > 1.5, "the initial load is skewed (CV 1.73 = everything on one expert of 4)"
    # measured: 1.70 -> 0.47 with alpha 0.1, 1.70 -> 1.55 without; the margins leave room for either to move
    assert with_aux[-1] < 0.5 * with_aux[0], "the aux loss at least halves the load's coefficient of variation"
    assert with_aux[-1] < 0.5 * without[-1], "and it is the aux loss that does it, not the task"


def test_moe_experts_grouped_gemm_kernel_equals_the_loop():
    """float32, so the Triton kernel runs (on the CPU under the interpreter): the layer's output
    and gradients with it equal the loop of matmuls. Tolerance: float32 sums of up to ~100 terms in
    another order (tiles of 16) err by a few ulps of the largest term, so 1e-5 of each tensor's
    largest magnitude (cancellation leaves single elements with larger relative errors); a row
    given to the wrong expert is off by O(1) of it."""
    from tinyscale.kernels import HAS_TRITON
    if not HAS_TRITON:
        pytest.skip("Triton is not installed")
    layer = _layer(E=4, k=2, cf=0.9, hidden=16).float()  # small: the interpreter runs ~1 ms per program
    x = torch.randn(1, 12, TINY.d_model, generator=torch.Generator().manual_seed(2))
    outs = []
    for impl in ("kernel", "loop"):
        layer.zero_grad()
        layer.experts.impl = impl
        y = layer(x)
        y.pow(2).sum().backward()
        outs.append((y.detach(), layer.experts.w_gate.grad.clone(), layer.experts.w_down.grad.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * b.abs().max().item())


def test_moe_flops_count_the_active_experts_not_all_of_them():
    """tinyscale.mfu's forward FLOPs of an MoE GPT equal torch's FlopCounterMode count (no
    assignment dropped): the router and k (+ shared) experts per token, whatever E is."""
    from torch.utils.flop_counter import FlopCounterMode

    from tinyscale.mfu import forward_flops
    counts = []
    for E in (4, 8):
        cfg = TINY.with_(attn_impl="math", moe_experts=E, moe_top_k=2, moe_shared_experts=1, moe_layers=(1,))
        model = GPT(cfg, dtype=torch.float64)  # float64: the experts' loop of matmuls (Triton's kernel is not counted)
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        with FlopCounterMode(display=False) as fwd:
            model(x, x)
        assert fwd.get_total_flops() == 2 * forward_flops(cfg, 16).forward
        counts.append(forward_flops(cfg, 16).mlp)
    C = TINY.d_model
    assert counts[1] - counts[0] == 16 * 2 * C * 4, "doubling E adds only the router's columns"


def test_moe_dispatch_then_combine_is_each_tokens_weighted_sum():
    """One process: dispatch gathers the kept assignments' rows in expert order, combine scatters
    w * row back onto each token (index_add_ over the dispatch permutation); a token whose every
    assignment was dropped gets zeros."""
    from tinyscale.moe import combine, dispatch
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    logits = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    r = route(logits, top_k=2, capacity_factor=0.5)  # capacity 2 of 12 assignments per expert: drops
    rows, plan = dispatch(x, r.token_index, r.counts)
    assert torch.equal(rows, x[r.token_index]) and plan.local_counts == r.counts.tolist()
    scale = torch.arange(1.0, 1.0 + rows.shape[0], dtype=torch.float64)[:, None]  # a different "expert" per row
    y = combine(rows * scale, r.token_index, r.weight, plan, 6)
    want = torch.zeros_like(x)
    for a in range(rows.shape[0]):
        want[r.token_index[a]] += r.weight[a] * scale[a] * x[r.token_index[a]]
    torch.testing.assert_close(y, want, rtol=1e-14, atol=0)
    assert r.dropped == 6
