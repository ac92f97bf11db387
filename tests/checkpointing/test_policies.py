"""Policies on the GPT: every policy trains bit-identically to none, with dropout on, and
changes no parameter name; bad policies fail with the field named."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.autograd.graph import save_on_cpu

from tinyscale.checkpointing import (
    POLICIES,
    CheckpointPolicy,
    SelectiveAttention,
    apply_policy,
    offload_to_host,
    policy_of,
    remove_policy,
)
from tinyscale.checkpointing.offload import _pack_to_host
from tinyscale.checkpointing.policies import _with_policy
from tinyscale.models import GPT, Block, GPTConfig, TinyMLP

# (policy, options): both checkpoint variants for the policies that checkpoint.
POLICY_CASES = [
    ("none", {}),
    ("full", {}),
    ("full", {"use_reentrant": True}),
    ("every_k", {"every_k": 2}),
    ("every_k", {"every_k": 2, "use_reentrant": True}),
    ("selective", {}),
    ("selective", {"use_reentrant": True}),
    ("offload", {}),
]
CASE_IDS = [p + ("-reentrant" if o.get("use_reentrant") else "") + (f"-k{o['every_k']}" if "every_k" in o else "")
            for p, o in POLICY_CASES]


def tiny(dropout=0.1, attn="math", n_layer=3, **changes) -> GPTConfig:
    return GPTConfig.preset("tiny").with_(dropout=dropout, attn_impl=attn, n_layer=n_layer, **changes)


def tokens(batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, seq), generator=g), torch.randint(0, 256, (batch, seq), generator=g)


def loss_grads_rng(model, idx, targets, seed):
    torch.manual_seed(seed)  # dropout masks come from the global generator
    loss = model(idx, targets)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return loss.detach(), grads, torch.get_rng_state()


@pytest.mark.parametrize(("policy", "options"), POLICY_CASES, ids=CASE_IDS)
@given(batch=st.integers(1, 3), seq=st.integers(1, 16), seed=st.integers(0, 2**16),
       attn=st.sampled_from(["math", "sdpa"]), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_activation_checkpoint_policy_grads_bit_identical_with_dropout(policy, options, batch, seq, seed, attn,
                                                                       dtype):
    """Same loss, same gradient for every parameter, and the global RNG left where a plain
    model leaves it, with dropout on attention probabilities and both residual branches."""
    cfg = tiny(attn=attn)
    idx, targets = tokens(batch, seq, seed)
    loss, grads, rng = loss_grads_rng(GPT(cfg, seed=seed, dtype=dtype), idx, targets, seed)
    model = apply_policy(GPT(cfg, seed=seed, dtype=dtype), policy, **options)
    got_loss, got_grads, got_rng = loss_grads_rng(model, idx, targets, seed)
    assert torch.equal(got_loss, loss)
    for name, grad in grads.items():
        assert torch.equal(got_grads[name], grad), f"{name}: max diff {(got_grads[name] - grad).abs().max():.3g}"
    assert torch.equal(got_rng, rng)


@pytest.mark.parametrize(("policy", "options"), POLICY_CASES, ids=CASE_IDS)
def test_activation_checkpoint_policy_trains_bit_identically_in_float64(policy, options):
    """Three AdamW steps with dropout: the parameters after each equal the plain model's."""
    cfg = tiny(tie_embeddings=True)

    def train(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(0)
        for step in range(3):
            idx, targets = tokens(2, 12, step)
            model(idx, targets).backward()
            opt.step()
            opt.zero_grad()
        return model.state_dict()

    want = train(GPT(cfg, seed=1, dtype=torch.float64))
    got = train(apply_policy(GPT(cfg, seed=1, dtype=torch.float64), policy, **options))
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("policy", POLICIES)
def test_activation_checkpoint_policy_keeps_names_parameters_and_state_dict(policy):
    model = GPT(tiny(n_layer=4), seed=2)
    names = [(n, id(p)) for n, p in model.named_parameters()]
    state = model.state_dict()
    kw = {"every_k": 2} if policy == "every_k" else {}
    assert apply_policy(model, policy, **kw) is model
    assert [(n, id(p)) for n, p in model.named_parameters()] == names  # same objects, same order
    assert list(model.state_dict()) == list(state)
    expected = {"none": ["plain"] * 4, "full": ["checkpointed"] * 4, "selective": ["selective"] * 4,
                "every_k": ["plain", "checkpointed"] * 2, "offload": ["offloaded"] * 4}[policy]
    assert policy_of(model) == expected
    other = apply_policy(GPT(tiny(n_layer=4), seed=5), "selective")
    other.load_state_dict(model.state_dict())  # across policies: same keys
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), state.values()))
    remove_policy(model)
    assert policy_of(model) == ["plain"] * 4 and all(type(b) is Block for b in model.blocks)
    assert [(n, id(p)) for n, p in model.named_parameters()] == names


def test_activation_checkpoint_policy_replaces_earlier_policy_and_keeps_train_mode():
    model = apply_policy(GPT(tiny(n_layer=4)).eval(), "full")
    apply_policy(model, "every_k", every_k=3)
    assert policy_of(model) == ["plain", "plain", "checkpointed", "plain"]
    assert not any(m.training for m in model.modules())
    model.train()
    assert all(m.training for m in model.modules())


@given(n_blocks=st.integers(0, 40), k=st.integers(1, 12))
def test_activation_checkpoint_every_k_picks_every_kth_block(n_blocks, k):
    picked = CheckpointPolicy("every_k", every_k=k).block_indices(n_blocks)
    assert len(picked) == n_blocks // k
    assert picked == [i for i in range(k - 1, n_blocks, k)]
    assert CheckpointPolicy("full").block_indices(n_blocks) == list(range(n_blocks))
    assert CheckpointPolicy("every_k", every_k=1).block_indices(n_blocks) == list(range(n_blocks))


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(policy="sqrt"), r"'sqrt' is unknown: choose one of none, full, every_k, selective, offload"),
    (dict(policy="Full"), "unknown"),
    (dict(policy="every_k"), "policy 'every_k' needs every_k, a positive int"),
    (dict(policy="every_k", every_k=0), "every_k=0"),
    (dict(policy="every_k", every_k=2.0), "every_k=2.0"),
    (dict(policy="full", every_k=2), "applies to policy 'every_k' only"),
    (dict(policy="full", use_reentrant="yes"), "use_reentrant='yes'"),
])
def test_activation_checkpoint_bad_policy_raises_value_error_naming_the_field(kwargs, match):
    model = GPT(tiny())
    with pytest.raises(ValueError, match=match):
        apply_policy(model, **kwargs)
    assert policy_of(model) == ["plain"] * 3  # nothing half-applied


def test_activation_checkpoint_policy_needs_a_gpt_and_keeps_blocks_and_hooks():
    """A policy changes each block's class in place: another holder of the block (a pipeline
    stage) and hooks registered on it (tensor parallelism's, ZeRO-3's) see the same object."""
    with pytest.raises(ValueError, match="needs a tinyscale GPT"):
        apply_policy(TinyMLP(), "full")
    model = GPT(tiny(dropout=0.0))
    blocks, calls = list(model.blocks), []
    model.blocks[1].register_forward_pre_hook(lambda *a: calls.append("block"))
    model.blocks[2].attn.register_forward_pre_hook(lambda *a: calls.append("attn"))
    for policy in ("full", "selective"):
        apply_policy(model, policy)
        assert list(model.blocks) == blocks and policy_of(model) == [{"full": "checkpointed"}.get(policy, policy)] * 3
        calls.clear()
        model(*tokens(2, 5, 0)).backward()
        # The block's hook runs outside its checkpoint: once. The attention's runs in the forward,
        # and again in the rerun of the whole block under "full" (which is why tensor parallelism's
        # hooks, entering the region, work under recomputation); "selective" reruns the core only.
        assert calls.count("block") == 1 and calls.count("attn") == {"full": 2, "selective": 1}[policy]


@given(seed=st.integers(0, 2**16), n_kv_head=st.sampled_from([1, 2, 4]), attn=st.sampled_from(["math", "sdpa"]),
       use_reentrant=st.booleans())
def test_activation_checkpoint_selective_attention_matches_gpt_attention(seed, n_kv_head, attn, use_reentrant):
    """SelectiveAttention overrides only Attention.core: the whole attention, forward and
    backward, is bit-identical to the GPT's own, dropout on."""
    model = GPT(tiny(n_kv_head=n_kv_head, attn=attn, dropout=0.3), seed=seed, dtype=torch.float64)
    attn_module, cos, sin = model.blocks[0].attn, model.rope_cos[:7], model.rope_sin[:7]
    twin = GPT(tiny(n_kv_head=n_kv_head, attn=attn, dropout=0.3), seed=seed, dtype=torch.float64).blocks[0].attn
    selective = _with_policy(SelectiveAttention, twin, use_reentrant=use_reentrant, preserve_rng_state=True)
    x = torch.randn(2, 7, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    results = []
    for module in (attn_module, selective):
        torch.manual_seed(seed)
        out = module(x, cos, sin)
        (out * out).sum().backward()
        results.append((out, x.grad, [p.grad.clone() for p in module.parameters()]))
        x.grad = None
        module.zero_grad()
    (out, gx, gp), (ref_out, ref_gx, ref_gp) = results[1], results[0]
    assert torch.equal(out, ref_out) and torch.equal(gx, ref_gx)
    assert all(torch.equal(a, b) for a, b in zip(gp, ref_gp, strict=True))


def test_activation_checkpoint_offload_agrees_with_torch_save_on_cpu():
    """Our hooks and torch's save_on_cpu: the same gradients, bit for bit, with dropout."""
    cfg = tiny()
    idx, targets = tokens(2, 10, 3)
    runs = []
    for context in (offload_to_host, save_on_cpu):
        model = GPT(cfg, seed=4)
        torch.manual_seed(1)
        with context():
            loss = model(idx, targets)
        loss.backward()
        runs.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_activation_checkpoint_offload_leaves_parameters_and_keeps_strides():
    weight = torch.nn.Parameter(torch.randn(3, 5))
    assert _pack_to_host(weight.t()) is not None and torch.is_tensor(_pack_to_host(weight.t()))
    assert _pack_to_host(weight.t())._base is weight  # not copied: a view of the parameter itself
    activation = torch.randn(5, 3, requires_grad=True).exp().t()  # non-contiguous, not a parameter
    device, host = _pack_to_host(activation)
    assert host.data_ptr() != activation.data_ptr() and host.stride() == activation.stride()
    assert torch.equal(host, activation)


def test_activation_checkpoint_policy_in_eval_and_no_grad():
    cfg = tiny()
    idx, _ = tokens(2, 8, 0)
    want = GPT(cfg, seed=6).eval()(idx)
    for policy in ("full", "selective", "offload"):
        model = apply_policy(GPT(cfg, seed=6), policy).eval()
        with torch.no_grad():
            assert torch.equal(model(idx), want)
