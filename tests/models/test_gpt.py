"""The shared GPT: parameter arithmetic, deterministic init, attention correctness, input errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tinyscale.models import GPT, PRESETS, GPTConfig, apply_rope, rope_tables

TINY = PRESETS["tiny"]


def unique_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def tokens(B: int, T: int, seed: int = 0, vocab_size: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- parameter arithmetic


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_models_num_params_matches_built_model_for_presets(name):
    cfg = GPTConfig.preset(name)
    model = GPT(cfg)
    assert cfg.num_params() == unique_numel(model)
    assert cfg.num_params(include_embedding=False) == unique_numel(model) - model.embed.weight.numel()


@given(
    n_layer=st.integers(1, 3),
    n_kv_head=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([2, 4, 6]),
    ffn_hidden=st.one_of(st.none(), st.integers(1, 50)),
    multiple_of=st.integers(1, 32),
    tie=st.booleans(),
    vocab_size=st.integers(1, 70),
    bias=st.booleans(),
)
def test_models_num_params_matches_built_model_for_drawn_configs(n_layer, n_kv_head, group, head_dim,
                                                                 ffn_hidden, multiple_of, tie, vocab_size, bias):
    n_head = n_kv_head * group
    cfg = GPTConfig(vocab_size=vocab_size, max_seq_len=8, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head,
                    d_model=n_head * head_dim, ffn_hidden=ffn_hidden, multiple_of=multiple_of,
                    tie_embeddings=tie, bias=bias)
    model = GPT(cfg)
    assert cfg.num_params() == unique_numel(model)
    assert model.blocks[0].mlp.w_up.out_features == cfg.ffn_dim
    if ffn_hidden is None:
        assert cfg.ffn_dim % multiple_of == 0 and cfg.ffn_dim >= 8 * cfg.d_model / 3 - 1


def test_models_big_preset_param_counts_are_exact():
    # Computed from shapes only: these presets are never instantiated.
    gpt2, llama = PRESETS["gpt2-124m"], PRESETS["llama-1b"]
    assert gpt2.num_params() == 123_551_232  # GPT-2 small: 124,439,808 with learned positions and biases
    assert llama.num_params() == 1_235_814_400  # Llama-3.2-1B: 1.24B
    assert gpt2.num_params(include_embedding=False) == 84_953_856
    assert llama.num_params(include_embedding=False) == 973_146_112
    # ffn_hidden=2048 makes GPT-2's SwiGLU MLP exactly as big as its original 2 x (C x 4C) MLP.
    assert 3 * gpt2.d_model * gpt2.ffn_dim == 2 * gpt2.d_model * 4 * gpt2.d_model
    assert llama.kv_dim == 512 and llama.head_dim == 64


def test_models_bias_counts_gpt2_style_linear_biases_and_none_in_moe_experts():
    """bias=True adds C + 2 K*D + C (wq, wk, wv, wo) and 2F + C (w_gate, w_up, w_down) per dense
    block; an MoE block keeps its attention biases, its experts and router have none."""
    cfg = GPTConfig(vocab_size=11, max_seq_len=8, n_layer=3, n_head=4, n_kv_head=2, d_model=8, ffn_hidden=6,
                    bias=True, moe_experts=2, moe_top_k=1, moe_layers=(1,), moe_shared_experts=1)
    model = GPT(cfg)
    assert cfg.num_params() == unique_numel(model)
    biases = {n: p.numel() for n, p in model.named_parameters() if n.endswith(".bias")}
    assert sum(biases.values()) == 3 * (8 + 2 * 4 + 8) + 2 * (2 * 6 + 8)
    assert not any(".mlp." in n for n in biases if n.startswith("blocks.1."))
    assert cfg.num_params() - cfg.with_(bias=False).num_params() == sum(biases.values())
    # GPT-2 small's shapes with biases: 7,936 per block (5C + 2F), the preset itself stays bias-free
    assert PRESETS["gpt2-124m"].with_(bias=True).num_params() == 123_551_232 + 12 * (5 * 768 + 2 * 2048)


def test_models_bias_starts_at_zero_and_leaves_the_weights_and_outputs_as_without():
    """Biases are zero at init and draw nothing: a biased GPT's weights and logits equal the
    bias-free one's; after a step they have gradients and move."""
    plain, biased = GPT(TINY, seed=3, dtype=torch.float64), GPT(TINY.with_(bias=True), seed=3, dtype=torch.float64)
    params = dict(biased.named_parameters())
    assert all(params[n].equal(p) for n, p in plain.named_parameters())
    assert all(p.eq(0).all() for n, p in params.items() if n.endswith(".bias"))
    idx = tokens(2, 8)
    torch.testing.assert_close(biased(idx), plain(idx), rtol=0, atol=0)
    biased(idx, tokens(2, 8, seed=1)).backward()
    grads = [p.grad for n, p in params.items() if n.endswith(".bias")]
    assert len(grads) == 7 * TINY.n_layer and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_models_ffn_dim_follows_llama_rule():
    assert GPTConfig(d_model=4096, n_head=32, multiple_of=256).ffn_dim == 11008  # Llama-2-7B's
    assert GPTConfig(d_model=64).ffn_dim == 176  # int(170.67) = 170, rounded up to 16
    assert GPTConfig(d_model=64, ffn_hidden=100).ffn_dim == 100


# ---------------------------------------------------------------- deterministic init


def test_models_same_seed_same_params_different_seed_different():
    a, b, c = GPT(TINY, seed=3), GPT(TINY, seed=3), GPT(TINY, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name


def test_models_init_ignores_global_rng_and_dtype():
    torch.manual_seed(0)
    a = GPT(TINY, seed=1)
    torch.manual_seed(12345)
    torch.randn(100)
    b = GPT(TINY, seed=1, dtype=torch.float64)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa.double(), pb), name  # drawn in float32, so float64 starts equal


def test_models_init_scales_residual_projections_and_sets_norms_to_one():
    cfg = PRESETS["small"]
    model = GPT(cfg)
    block = model.blocks[0]
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
    assert block.attn.wo.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert block.mlp.w_down.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert block.attn.wq.weight.std().item() == pytest.approx(cfg.init_std, rel=0.05)
    for norm in (block.attn_norm, block.mlp_norm, model.norm):
        assert torch.equal(norm.weight, torch.ones_like(norm.weight))


def test_models_meta_device_then_reset_matches_direct_init():
    direct = GPT(TINY, seed=7)
    lazy = GPT(TINY, seed=7, device="meta").to_empty(device="cpu")
    lazy.reset_parameters(7)
    for (name, a), b in zip(direct.state_dict().items(), lazy.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(direct.rope_cos, lazy.rope_cos) and torch.equal(direct.rope_sin, lazy.rope_sin)


def test_models_meta_device_draws_nothing(monkeypatch):
    """On the meta device nothing is filled: the init draws no values (it drew each parameter's on
    the CPU and threw them away: minutes for Mixtral 8x7B's 47B), and the shapes are the real ones."""
    from tinyscale.planner.models import resolve_model

    draws = []
    normal = torch.Tensor.normal_
    monkeypatch.setattr(torch.Tensor, "normal_",  # draws into real memory (nn.Embedding's own init stays on meta)
                        lambda t, *a, **k: (t.is_meta or draws.append(t.numel())) and None or normal(t, *a, **k))
    cfg = resolve_model("mixtral-8x7b")
    model = GPT(cfg, device="meta")
    assert draws == []
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_models_state_dict_holds_parameters_only():
    model = GPT(TINY)
    assert not any("rope" in key for key in model.state_dict())
    assert set(model.state_dict()) == {name for name, _ in model.named_parameters(remove_duplicate=False)}


def test_models_tied_head_shares_storage_and_sums_both_gradients():
    cfg = TINY.with_(tie_embeddings=True)
    tied = GPT(cfg, dtype=torch.float64)
    assert tied.head.weight is tied.embed.weight
    assert tied.head.weight.data_ptr() == tied.embed.weight.data_ptr()
    assert "head.weight" not in dict(tied.named_parameters())
    # An untied model holding the same matrix twice: the tied gradient is the sum of both uses.
    untied = GPT(cfg.with_(tie_embeddings=False), dtype=torch.float64)
    untied.load_state_dict(tied.state_dict())
    idx, tgt = tokens(2, 16, seed=1), tokens(2, 16, seed=2)
    tied(idx, tgt).backward()
    untied(idx, tgt).backward()
    expected = untied.embed.weight.grad + untied.head.weight.grad
    torch.testing.assert_close(tied.embed.weight.grad, expected, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------- forward correctness


def test_models_float64_model_trains_end_to_end():
    model = GPT(TINY, dtype=torch.float64)
    idx, tgt = tokens(3, 20, seed=1), tokens(3, 20, seed=2)
    loss = model(idx, tgt)
    assert loss.dtype == torch.float64 and model(idx).shape == (3, 20, 256)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float64 and torch.isfinite(p.grad).all(), name


def test_models_bf16_forward_and_backward_run():
    model = GPT(TINY, dtype=torch.bfloat16)
    loss = model(tokens(2, 16), tokens(2, 16, seed=1))
    assert loss.dtype == torch.float32  # cross-entropy is taken in at least float32
    loss.backward()
    assert math.isfinite(loss.item()) and model.embed.weight.grad.dtype == torch.bfloat16


def test_models_loss_at_init_is_near_ln_vocab():
    # Small init -> near-uniform logits -> loss ln(256) = 5.545.
    loss = GPT(PRESETS["small"], dtype=torch.float64)(tokens(4, 64), tokens(4, 64, seed=1))
    assert abs(loss.item() - math.log(256)) < 0.05


def test_models_loss_is_mean_over_rows_of_row_means():
    # Data parallelism averages per-rank mean losses: that equals the global mean only because
    # every row weighs the same.
    model = GPT(TINY, dtype=torch.float64)
    idx, tgt = tokens(4, 12, seed=1), tokens(4, 12, seed=2)
    per_row = torch.stack([model(idx[i:i + 1], tgt[i:i + 1]) for i in range(4)])
    torch.testing.assert_close(model(idx, tgt), per_row.mean(), rtol=1e-13, atol=0)


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_models_attention_is_causal(impl):
    model = GPT(TINY.with_(attn_impl=impl), dtype=torch.float64)
    idx = tokens(2, 24)
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256  # change every token from position 10 on
    before, after = model(idx), model(changed)
    assert torch.equal(before[:, :10], after[:, :10])  # earlier positions: bit-identical
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_models_math_and_sdpa_attention_agree():
    sdpa = GPT(TINY, dtype=torch.float64)
    math_ = GPT(TINY.with_(attn_impl="math"), dtype=torch.float64)
    idx, tgt = tokens(2, 32), tokens(2, 32, seed=1)
    torch.testing.assert_close(sdpa(idx), math_(idx), rtol=0, atol=1e-12)
    sdpa(idx, tgt).backward()
    math_(idx, tgt).backward()
    for (name, a), b in zip(sdpa.named_parameters(), math_.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12, msg=name)


def test_models_gqa_equals_mha_with_repeated_kv_weights():
    gqa = GPT(TINY, dtype=torch.float64)  # 4 query heads, 2 K/V heads
    mha = GPT(TINY.with_(n_kv_head=None), dtype=torch.float64)
    group, D = TINY.n_head // TINY.kv_heads, TINY.head_dim
    state = gqa.state_dict()
    for key, weight in state.items():
        if key.endswith(("attn.wk.weight", "attn.wv.weight")):
            # (K*D, C) -> (K, D, C) -> each K/V head repeated for its query group -> (H*D, C)
            state[key] = weight.view(-1, D, weight.shape[-1]).repeat_interleave(group, dim=0).flatten(0, 1)
    mha.load_state_dict(state)
    idx = tokens(2, 20)
    torch.testing.assert_close(gqa(idx), mha(idx), rtol=0, atol=1e-12)


def test_models_dropout_is_inactive_in_eval_mode():
    plain, dropped = GPT(TINY, seed=2), GPT(TINY.with_(dropout=0.5), seed=2)
    idx = tokens(2, 16)
    assert torch.equal(plain(idx), dropped.eval()(idx))
    dropped.train()
    assert not torch.equal(plain(idx), dropped(idx))


@given(m=st.integers(0, 20), n=st.integers(0, 20), shift=st.integers(0, 11), seed=st.integers(0, 100))
def test_models_rope_scores_depend_only_on_relative_position(m, n, shift, seed):
    cos, sin = rope_tables(32, 8, 10000.0)
    q, k = torch.randn(2, 1, 1, 1, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

    def score(i: int, j: int) -> torch.Tensor:  # q at position i against k at position j
        return (apply_rope(q, cos[i:i + 1], sin[i:i + 1]) * apply_rope(k, cos[j:j + 1], sin[j:j + 1])).sum()

    torch.testing.assert_close(score(m, n), score(m + shift, n + shift), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("bad_id", [256, -1])
def test_models_out_of_vocab_ids_raise(bad_id):
    model = GPT(TINY)
    idx = tokens(2, 8)
    idx[1, 5] = bad_id
    with pytest.raises(ValueError, match=rf"idx contains token id {bad_id} at position \(1, 5\).*0\.\.255"):
        model(idx)
    with pytest.raises(ValueError, match=rf"targets contains token id {bad_id}"):
        model(tokens(2, 8), idx)


def test_models_bad_input_shapes_raise():
    model = GPT(TINY)
    with pytest.raises(ValueError, match="T=33 > max_seq_len=32"):
        model(tokens(1, 33))
    with pytest.raises(ValueError, match="2-D"):
        model(tokens(1, 8)[0])
    with pytest.raises(ValueError, match="int64"):
        model(tokens(1, 8).float())
    with pytest.raises(ValueError, match="targets shape"):
        model(tokens(2, 8), tokens(2, 7))


@pytest.mark.parametrize("changes, field", [
    (dict(d_model=30), "d_model"),  # not a multiple of n_head
    (dict(d_model=12, n_head=4, n_kv_head=None), "d_model"),  # head_dim 3 is odd
    (dict(n_kv_head=3), "n_kv_head"),
    (dict(n_kv_head=0), "n_kv_head"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(n_layer=2.0), "n_layer"),
    (dict(ffn_hidden=-4), "ffn_hidden"),
    (dict(attn_impl="flash"), "attn_impl"),
    (dict(dropout=1.0), "dropout"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(bias=1), "bias"),
])
def test_models_invalid_config_names_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"GPTConfig\.{field}="):
        TINY.with_(**changes)


def test_models_unknown_preset_lists_the_choices():
    with pytest.raises(ValueError, match="gpt2-124m"):
        GPTConfig.preset("gpt5")
