"""The analytic matmul FLOPs equal torch's FlopCounterMode count exactly (forward, backward,
and with recomputation), and the shortcuts differ from them by exactly what they leave out."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

import tinyscale.models.gpt as gpt_module
from tinyscale.mfu import (
    approximations,
    attention_share,
    forward_flops,
    hfu,
    matmul_params,
    model_flops_per_token,
)
from tinyscale.models import GPT, GPTConfig


def _counted(model: GPT, batch: int, seq_len: int, seed: int = 0) -> tuple[int, int]:
    """(forward, backward) FLOPs of one training step, as FlopCounterMode counts them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen)
    y = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen)
    with FlopCounterMode(display=False) as fwd:
        loss = model(x, y)
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


@st.composite
def configs(draw) -> GPTConfig:
    """Small GPTs with every shape feature: GQA, odd vocab and FFN sizes, tied or untied head."""
    n_head = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([2, 4, 6]))
    return GPTConfig(
        vocab_size=draw(st.integers(3, 70)),
        max_seq_len=16,
        n_layer=draw(st.integers(1, 3)),
        n_head=n_head,
        n_kv_head=draw(st.sampled_from([k for k in (1, 2, 4) if n_head % k == 0] + [None])),
        d_model=n_head * head_dim,
        ffn_hidden=draw(st.one_of(st.none(), st.integers(1, 40))),
        tie_embeddings=draw(st.booleans()),
        attn_impl="math",  # explicit matmuls: FlopCounterMode sees them (SDPA on CPU counts 0)
    )


# FLOP counts are integers: every comparison below is exact (==), no tolerance.
@given(cfg=configs(), seq_len=st.integers(1, 16), batch=st.integers(1, 3))
def test_mfu_flops_match_flop_counter_exactly(cfg, seq_len, batch):
    f = forward_flops(cfg, seq_len)
    counted_fwd, counted_bwd = _counted(GPT(cfg), batch, seq_len)
    assert counted_fwd == batch * f.forward
    assert counted_bwd == batch * f.backward == 2 * batch * f.forward
    assert batch * f.model == counted_fwd + counted_bwd


@pytest.mark.parametrize("preset, seq_lens", [("tiny", [1, 7, 32]), ("small", [16, 128])])
@pytest.mark.parametrize("tied", [False, True])
def test_mfu_flops_match_flop_counter_on_presets(preset, seq_lens, tied):
    cfg = GPTConfig.preset(preset).with_(attn_impl="math", tie_embeddings=tied)
    model = GPT(cfg)
    for T in seq_lens:
        assert _counted(model, 2, T) == (2 * forward_flops(cfg, T).forward, 2 * forward_flops(cfg, T).backward)
        model.zero_grad(set_to_none=True)


class _Recomputed(nn.Module):
    """A block run under torch.utils.checkpoint: its forward runs again during backward."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x, cos, sin):
        return checkpoint(self.block, x, cos, sin, use_reentrant=False)


@given(cfg=configs(), seq_len=st.integers(1, 16), data=st.data())
def test_mfu_hardware_flops_with_full_recompute_match_flop_counter(cfg, seq_len, data):
    layers = data.draw(st.integers(0, cfg.n_layer), label="recomputed_layers")
    model = GPT(cfg)
    for i in range(layers):
        model.blocks[i] = _Recomputed(model.blocks[i])
    f = forward_flops(cfg, seq_len)
    with set_checkpoint_early_stop(False):  # re-run the whole block
        assert sum(_counted(model, 1, seq_len)) == f.hardware("full", layers, early_stop=False)
    # torch's default stops recomputing once every saved tensor is back: the block's last
    # matmul (w_down: its output is not saved for backward) is not redone.
    assert sum(_counted(model, 1, seq_len)) == f.hardware("full", layers, early_stop=True)
    w_down = 2 * seq_len * cfg.ffn_dim * cfg.d_model
    assert f.hardware("full", layers, early_stop=False) - f.hardware("full", layers) == layers * w_down


def test_mfu_hardware_flops_with_selective_recompute_match_flop_counter(monkeypatch):
    cfg = GPTConfig.preset("tiny").with_(attn_impl="math")
    plain = gpt_module.causal_attention

    def recomputed_core(q, k, v, **kwargs):  # the attention core only (Korthikanti et al., sec. 4)
        return checkpoint(lambda q, k, v: plain(q, k, v, **kwargs), q, k, v, use_reentrant=False)

    monkeypatch.setattr(gpt_module, "causal_attention", recomputed_core)
    f = forward_flops(cfg, 32)
    with set_checkpoint_early_stop(False):
        assert sum(_counted(GPT(cfg), 2, 32)) == 2 * f.hardware("selective", early_stop=False)
    assert f.hardware("selective", early_stop=False) - f.model == f.attention  # Q K^T and P V once more
    # With early stop, P V (whose output backward does not need) is not redone.
    assert sum(_counted(GPT(cfg), 2, 32)) == 2 * f.hardware("selective") == 2 * (f.model + f.scores)


@given(cfg=configs(), seq_len=st.integers(1, 4096))
def test_mfu_palm_formula_is_exact_with_matmul_params(cfg, seq_len):
    """6N + 12LHQT is exact when N counts the matmul weights (the head included, tied or not);
    with N = non-embedding parameters it is off by the norm weights, or by the whole tied head."""
    a = approximations(cfg, seq_len)
    assert a["6N + 12LHQT (matmul N)"] == a["exact"]
    norms = cfg.n_layer * 2 * cfg.d_model + cfg.d_model
    head = cfg.vocab_size * cfg.d_model
    missing_head = head if cfg.tie_embeddings else 0
    assert a["6N + 12LHQT (non-embedding N)"] == a["exact"] + 6 * norms - 6 * missing_head
    attention = 12 * cfg.n_layer * cfg.d_model * seq_len
    assert a["6N (non-embedding)"] == a["exact"] + 6 * norms - 6 * missing_head - attention
    assert a["6N (all params)"] == a["exact"] + 6 * norms + 6 * (0 if cfg.tie_embeddings else head) - attention


def test_mfu_causal_counts_half_the_attention_square():
    cfg = GPTConfig.preset("small")
    full, causal = forward_flops(cfg, 128), forward_flops(cfg, 128, causal=True)
    assert causal.attention * 2 * 128 == full.attention * 129  # T(T+1)/2 of T^2 query-key pairs
    assert causal.mlp == full.mlp and causal.head == full.head


def test_mfu_attention_share_grows_with_sequence_length():
    cfg = GPTConfig.preset("llama-1b")
    shares = [attention_share(cfg, T) for T in (512, 2048, 8192, 32768, 131072)]
    assert shares == sorted(shares)
    C, T = cfg.d_model, 8192
    assert shares[2] == pytest.approx(12 * C * T * cfg.n_layer / (6 * matmul_params(cfg) + 12 * C * T * cfg.n_layer),
                                      rel=1e-12)  # float division only


def test_mfu_bad_inputs_raise_clear_errors():
    cfg = GPTConfig.preset("tiny")
    with pytest.raises(ValueError, match="seq_len"):
        forward_flops(cfg, 0)
    with pytest.raises(TypeError, match="GPTConfig"):
        model_flops_per_token({"d_model": 32}, 8)
    with pytest.raises(ValueError, match="recompute"):
        forward_flops(cfg, 8).hardware("sometimes")
    with pytest.raises(ValueError, match="recomputed_layers"):
        forward_flops(cfg, 8).hardware("full", recomputed_layers=cfg.n_layer + 1)
    with pytest.raises(ValueError, match="recompute"):
        hfu(1000.0, cfg, 1e12, recompute="all")
    with pytest.raises(ValueError, match="early_stop"):
        forward_flops(cfg, 8).hardware("full", early_stop="yes")


# Models whose regions end differently: a dense MLP (w_down last, nothing saves its output), residual
# dropout after it (stream or counter masks: a mask drawn from w_down's output is saved), an MoE block
# with shared experts (their w_down last) and without (the combine saves the routed experts' outputs).
_RERUN_MODELS = {
    "dense": {}, "stream-dropout": {"dropout": 0.1}, "counter-dropout": {"dropout": 0.1, "dropout_masks": "counter"},
    "moe-shared": {"moe_experts": 4, "moe_top_k": 2, "moe_shared_experts": 1}, "moe": {"moe_experts": 4, "moe_top_k": 2},
}


@pytest.mark.parametrize("model", _RERUN_MODELS)
@pytest.mark.parametrize("variant", ["reentrant", "early-stop", "no-early-stop"])
@pytest.mark.parametrize("policy, every_k", [("none", None), ("full", None), ("selective", None), ("every_k", 2)])
def test_mfu_hfu_matches_flop_counter_under_the_checkpointing_policies(policy, every_k, variant, model, monkeypatch):
    """The engine's HFU maps a config to (recompute, layers, early_stop); the FLOPs a real backward
    runs under tinyscale's checkpoint (counted by FlopCounterMode, the forward's own included)
    equal the formula exactly: whole regions re-entrantly or with early_stop=False, all but an
    unsaved last matmul with early stop (the non-re-entrant default)."""

    import tinyscale.checkpointing.policies as policies
    from tinyscale.checkpointing import apply_policy
    from tinyscale.config import EngineConfig
    from tinyscale.engine.throughput import early_stop_of, recompute_of

    cfg = GPTConfig.preset("tiny").with_(attn_impl="math", **_RERUN_MODELS[model])  # 2 layers: every_k=2 reruns 1
    ac = {"policy": policy, "every_k": every_k, "use_reentrant": variant == "reentrant"}
    config = EngineConfig.load({"train_batch_size": 2, "activation_checkpointing": ac})
    recompute, layers = recompute_of(config, cfg.n_layer)
    early_stop = early_stop_of(config, tp=config.parallel.tensor)
    assert early_stop == (variant != "reentrant")
    if variant == "no-early-stop":  # apply_policy leaves early_stop at checkpoint()'s default: turn it off
        monkeypatch.setattr(policies, "checkpoint", functools.partial(policies.checkpoint, early_stop=False))
        early_stop = False
    # float64: an MoE's experts run as a loop of matmuls FlopCounterMode sees (not a Triton kernel)
    model = apply_policy(GPT(cfg, dtype=torch.float64), policy, every_k=every_k, use_reentrant=variant == "reentrant")
    assert sum(_counted(model, 2, 32)) == 2 * forward_flops(cfg, 32).hardware(recompute, layers, early_stop)


# Layouts whose rerun the GPT's config alone does not tell (all selective, each a P v per region):
# tensor parallelism with dropout runs the attention core as matmuls whatever attn_impl says (each
# rank's dropout is a function, which SDPA cannot take), so the early stop skips its P v; under the
# "eager" compile backend, where a captured region reruns whole, the rerun stops early (as torch's
# eager checkpoint does) with counter dropout (a graph break in the region) and with tensor
# parallelism's exact dropout (its blocks break at their collectives; the tracker mode is refused
# there: engine/compiled.py).
# (world, GPTConfig options, config options). Vocab 64: tp 2 divides it, so no padded head rows run.
_EAGER = {"compile": {"enabled": True, "backend": "eager"}}
_LAYOUT_RERUNS = {
    "tp2-sdpa-tracker-dropout": (2, {"dropout": 0.1}, {"parallel": {"tensor": 2, "tensor_dropout": "tracker"}}),
    "compiled-eager-counter-dropout": (1, {"dropout": 0.1, "dropout_masks": "counter"}, _EAGER),
    "compiled-eager-tp2-exact-dropout": (2, {"dropout": 0.1}, {"parallel": {"tensor": 2}, **_EAGER}),
}
_ROWS, _SEQ = 4, 16  # 16 tokens: hardware FLOPs / 16 is an exact float, so the comparison below is ==


def _engine_steps_flops(cases: list[tuple[dict, dict]]) -> list[tuple[int, float]]:
    """Per (GPTConfig options, config options): this rank's matmul FLOPs in one engine step
    (FlopCounterMode; a compiled case after one uncounted step, which compiles), and the hardware
    FLOPs per token the engine's HFU counts for the whole job."""
    import tinyscale as ts
    from tinyscale.data import synthetic_token_batches

    out = []
    for model_options, config_options in cases:
        torch._dynamo.reset()
        cfg = GPTConfig(vocab_size=64, max_seq_len=_SEQ, n_layer=2, n_head=4, n_kv_head=2, d_model=16, ffn_hidden=24,
                        tie_embeddings=True, **model_options)  # attn_impl "sdpa", the default
        config = {"train_batch_size": _ROWS, "activation_checkpointing": {"policy": "selective"}, **config_options}
        engine = ts.initialize(GPT(cfg, seed=0, dtype=torch.float64), config)
        first, second = synthetic_token_batches(num_batches=2, batch_size=_ROWS, seq_len=_SEQ, vocab_size=64, seed=0)
        if "compile" in config_options:
            engine.train_batch(first)
        with FlopCounterMode(display=False) as counter:
            engine.train_batch(second)
        out.append((counter.get_total_flops(), engine.throughput.tracker.hardware_flops_per_token))
    return out


@functools.cache
def _layout_flops(world: int) -> dict[str, list[tuple[int, float]]]:
    """{layout: per rank (FLOPs, hardware FLOPs per token)} for the layouts of this world size, in one call."""
    from tinyscale.testing import run_on_ranks

    names = [name for name, (w, _, _) in _LAYOUT_RERUNS.items() if w == world]
    cases = [_LAYOUT_RERUNS[name][1:] for name in names]
    per_rank = run_on_ranks(_engine_steps_flops, world, cases) if world > 1 else [_engine_steps_flops(cases)]
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(names)}


@pytest.mark.parametrize("layout", _LAYOUT_RERUNS)
def test_mfu_hfu_matches_flop_counter_where_the_layout_decides_the_rerun(layout):
    """The engine's HFU (`explicit_core_of`, `early_stop_of` with the GPT's config) equals the FLOPs
    the step runs, summed over the ranks (tp: each runs its heads' and FFN columns' share)."""
    per_rank = _layout_flops(_LAYOUT_RERUNS[layout][0])[layout]
    assert len({per_token for _, per_token in per_rank}) == 1  # every rank counts the job's FLOPs alike
    assert sum(flops for flops, _ in per_rank) == _ROWS * _SEQ * per_rank[0][1]
