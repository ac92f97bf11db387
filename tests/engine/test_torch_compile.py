"""`compile: {"enabled": true}`: torch.compile of the GPT's blocks (`pytest -k torch_compile`; issue 28, DS-31).

Compiled training equals eager training, and every block reuses one compilation:

- default suite, backend "aot_eager" (Dynamo's graph capture and AOTAutograd's joint forward and
  backward graphs, run by eager kernels: what decides whether hooks, collectives and graph breaks
  compose, in under a tenth of inductor's compile time on this machine): dp 2 at ZeRO 3 (its gather
  and release hooks around the compiled blocks) on 2 ranks, equal to the same layout run eagerly
  and to `tinyscale.reference.train` (float64, rtol 1e-10);
- `--thorough`, backend "inductor" (C++ kernels it generates and fuses): one process at ZeRO 0,
  one process with stream dropout and `options.fallback_random` (torch's random numbers), dp 2
  at ZeRO 3 and tp 2 with sequence parallelism, against the same references; and with
  "aot_eager" tp 2 with sequence parallelism (its collectives break each block's graph), the
  pipeline, context parallelism, counter dropout, an MoE GPT and the offload checkpointing policy.

The tolerance is the suite's float64 rtol 1e-10 (`tinyscale.testing`), unchanged: inductor fuses
and reorders float operations (a fused kernel sums a row in another order, keeps an intermediate
in a register instead of rounding it through memory), so results may differ from eager in the last
bits, each op's relative error being at most about 2^-53 = 1.1e-16; a step chains a few hundred
such ops and three AdamW steps (whose update m / (sqrt(v) + eps) is relatively as accurate as the
gradient), which stays within 1e3 x 1e-16 = 1e-13, three orders below rtol 1e-10. Measured with inductor
after 3 steps (worst rank): losses within 4.3e-16 relative of one process's, parameters within
8.4e-16 (ZeRO 0), 5.6e-16 (dp 2, ZeRO 3) and 5.1e-16 (tp 2 + SP) absolute.

The model is the odd GPT of the other engine tests at its smallest: vocab 61 (tp 2 pads it),
4 query / 2 K/V heads, a tied embedding, clipping every step hits, weight decay, 2 micro-batches
of accumulation.
"""

from __future__ import annotations

import functools

import pytest
import torch

import tinyscale as ts
from tinyscale import ConfigError
from tinyscale.data import synthetic_token_batches
from tinyscale.engine.compiled import compiled_graphs
from tinyscale.models import GPT, GPTConfig
from tinyscale.reference import train as reference_train
from tinyscale.testing import assert_losses_close, assert_state_dicts_close, run_on_ranks

VOCAB, SEQ, STEPS, ROWS = 61, 10, 3, 4


def gpt(n_layer: int = 2, **extra) -> GPT:
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, n_layer=n_layer, n_head=4, n_kv_head=2, d_model=16,
                    ffn_hidden=20, tie_embeddings=True, **extra)
    return GPT(cfg, seed=5, dtype=torch.float64)


def config(parallel: dict | None = None, stage: int = 0, backend: str | None = None,
           compile_kwargs: dict | None = None, **extra) -> dict:
    c = {"train_batch_size": ROWS, "gradient_accumulation_steps": 2, "gradient_clipping": 0.05,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05}},
         "zero_optimization": {"stage": stage}, "parallel": parallel or {}, **extra}
    if backend is not None:
        c["compile"] = {"enabled": True, "backend": backend, "compile_kwargs": compile_kwargs or {}}
    return c


def batches():
    return synthetic_token_batches(num_batches=STEPS, batch_size=ROWS, seq_len=SEQ, vocab_size=VOCAB, seed=3)


# name -> (world, parallel, ZeRO stage, model options, config options)
LAYOUTS = {
    "zero0": (1, {}, 0, {}, {}),
    "dp2-zero3": (2, {}, 3, {}, {}),
    "tp2-sp": (2, {"tensor": 2, "sequence_parallel": True}, 0, {}, {}),
    "pp2": (2, {"pipeline": 2}, 1, {"n_layer": 4}, {}),
    "cp2": (2, {"context": 2}, 2, {}, {}),
    "dp2-counter-dropout": (2, {}, 0, {"dropout": 0.1, "dropout_masks": "counter"}, {}),
    "moe": (1, {}, 0, {"moe_experts": 4, "moe_top_k": 2}, {}),
    "dp2-offload-checkpointing": (2, {}, 2, {}, {"activation_checkpointing": {"policy": "offload"}}),
    # stream dropout: inductor draws torch's random numbers only with fallback_random (else refused)
    "dropout-fallback-random": (1, {}, 0, {"dropout": 0.1}, {"compile_kwargs": {"options": {"fallback_random": True}}}),
}


def _train(cases: list[tuple[str, str | None]]) -> list:
    """On each rank: each (layout, backend or None for eager) trained by a fresh engine; its
    losses, full state and Dynamo's counts (counters cleared before each case)."""
    from torch._dynamo.utils import counters

    out = []
    for name, backend in cases:
        _, parallel, stage, model_options, extra = LAYOUTS[name]
        torch._dynamo.reset()
        counters.clear()
        model = gpt(**model_options)  # (its nn.Linear init draws from the global generator)
        torch.manual_seed(0)  # stream dropout's masks: the reference draws them after the same seed
        engine = ts.initialize(model, config(parallel, stage, backend, **extra))
        losses = [engine.train_batch(b) for b in batches()]
        out.append((losses, engine.full_state_dict(), compiled_graphs(engine.model) if backend else None))
    return out


@functools.cache
def reference(name: str):
    _, _, _, model_options, extra = LAYOUTS[name]
    model = gpt(**model_options)
    torch.manual_seed(0)
    losses = reference_train(model, batches(), config(**{k: v for k, v in extra.items() if k != "compile_kwargs"}))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@functools.cache
def trained(world: int, names: tuple[str, ...], backend: str) -> dict:
    """{(name, backend or None): per-rank results}, eager and compiled, in one pooled call."""
    cases = [(n, b) for n in names for b in (None, backend)]
    per_rank = run_on_ranks(_train, world, cases, timeout_s=900) if world > 1 else [_train(cases)]
    return {case: [rank[i] for rank in per_rank] for i, case in enumerate(cases)}


def check_layout(world: int, names: tuple[str, ...], name: str, backend: str) -> None:
    results = trained(world, names, backend)
    losses, state = reference(name)
    for rank, ((eager_losses, eager_state, _), (comp_losses, comp_state, graphs)) in enumerate(
            zip(results[(name, None)], results[(name, backend)])):
        for what, got, got_state in (("eager", eager_losses, eager_state), ("compiled", comp_losses, comp_state)):
            assert_losses_close(got, losses)
            assert_state_dicts_close(got_state, state, what=f"{name} {what}, rank {rank}")
        assert_losses_close(comp_losses, eager_losses)
        assert_state_dicts_close(comp_state, eager_state, what=f"{name} compiled vs eager, rank {rank}")
        # One compilation for all blocks: the blocks' forward has one cache entry (a second block
        # or a later call that failed its guards would add one), and the blocks ran compiled.
        assert graphs["block_entries"] == 1 and graphs["graphs"] >= 1, (name, rank, graphs)


def test_torch_compile_aot_eager_under_zero3_hooks_trains_like_eager_and_one_process():
    check_layout(2, ("dp2-zero3",), "dp2-zero3", "aot_eager")


THOROUGH_AOT = ("tp2-sp", "pp2", "cp2", "dp2-counter-dropout", "dp2-offload-checkpointing")


@pytest.mark.thorough
@pytest.mark.parametrize("name", THOROUGH_AOT)
def test_torch_compile_aot_eager_composes_with_pipeline_context_dropout_offload(name):
    check_layout(2, THOROUGH_AOT, name, "aot_eager")


@pytest.mark.thorough
def test_torch_compile_aot_eager_moe_gpt_trains_like_eager():
    check_layout(1, ("moe",), "moe", "aot_eager")


@pytest.mark.thorough
def test_torch_compile_inductor_one_process_trains_like_eager_with_one_graph_for_all_blocks():
    check_layout(1, ("zero0",), "zero0", "inductor")
    comp = trained(1, ("zero0",), "inductor")[("zero0", "inductor")][0]
    assert comp[2]["graphs"] == 1  # no graph break: one forward graph, run by both blocks


SHARDED = ("dp2-zero3", "tp2-sp")


@pytest.mark.thorough
def test_torch_compile_inductor_stream_dropout_with_fallback_random_draws_eagers_masks():
    check_layout(1, ("dropout-fallback-random",), "dropout-fallback-random", "inductor")


@pytest.mark.thorough
@pytest.mark.parametrize("name", SHARDED)
def test_torch_compile_inductor_sharded_layouts_train_like_eager(name):
    check_layout(2, SHARDED, name, "inductor")


# --- what is refused, and the config's shapes

def _refusal(model: GPT, **cfg) -> str:
    with pytest.raises(ConfigError) as err:
        ts.initialize(model, config(backend="inductor", **cfg))
    return str(err.value)


def test_torch_compile_refuses_checkpointed_blocks_and_inductor_stream_dropout_by_name():
    message = _refusal(gpt(), activation_checkpointing={"policy": "full"})
    assert "compile.enabled" in message and "activation_checkpointing.policy='full'" in message
    message = _refusal(gpt(dropout=0.1))
    assert "compile.enabled" in message and "dropout" in message and "fallback_random" in message
    with pytest.raises(ConfigError, match="compile.enabled: tinyscale compiles the blocks of its own GPT"):
        ts.initialize(torch.nn.Sequential(torch.nn.Linear(2, 2)), config(backend="inductor"))


def test_torch_compile_config_shorthand_and_deepcompile_keys_noted():
    cfg = ts.EngineConfig.load({"train_batch_size": 2, "compile": True})
    assert cfg.compile.enabled and cfg.compile.backend == "inductor"
    assert not ts.EngineConfig.load({"train_batch_size": 2, "compile": False}).compile.enabled
    cfg = ts.EngineConfig.load({"train_batch_size": 2, "compile": {"deepcompile": True, "enabled": True,
                                                                   "compile_kwargs": {"mode": "max-autotune"}}})
    assert cfg.compile.enabled and cfg.compile.compile_kwargs == {"mode": "max-autotune"}
    assert len(cfg.notes) == 1 and cfg.notes[0].startswith("compile.deepcompile = true: no effect here")
    with pytest.raises(ConfigError, match="compile.compile_kwargs"):
        ts.EngineConfig.load({"train_batch_size": 2, "compile": {"compile_kwargs": {"backend": "eager"}}})


def test_torch_compile_deepspeed_engine_compile_method_trains_like_train_batch():
    """DeepSpeed's `engine.compile(backend, compile_kwargs)` on the DeepSpeed API: the loop after it
    equals the eager engine's train_batch (float64, rtol 1e-10), and the blocks ran compiled."""
    import tinyscale.deepspeed as deepspeed
    from torch._dynamo.utils import counters

    cfg = config()
    engine = ts.initialize(gpt(), cfg)
    expected = [engine.train_batch(b) for b in batches()]
    torch._dynamo.reset()
    counters.clear()
    ds, *_ = deepspeed.initialize(model=gpt(), config=cfg)
    assert not ds.is_compiled
    ds.compile(backend="aot_eager", compile_kwargs={"backend": "ignored, as DeepSpeed overrides it"})
    assert ds.is_compiled
    losses = []
    for inputs, targets in batches():
        for rows in range(0, ROWS, ROWS // 2):  # 2 micro-batches of accumulation
            ds.backward(ds(inputs[rows:rows + ROWS // 2], targets[rows:rows + ROWS // 2]))
            ds.step()
        losses.append(ds.engine.last_step["loss"])
    assert_losses_close(losses, expected)
    assert_state_dicts_close(ds.engine.full_state_dict(), engine.full_state_dict())
    assert compiled_graphs(ds.module) == {"graphs": 1, "block_entries": 1}
    with pytest.raises(NotImplementedError, match="compiled_autograd_enabled"):
        ds.compile(compiled_autograd_enabled=True)


def test_torch_compile_fuse_linear_relu_by_pattern_keeps_outputs_and_gradients():
    """DS-31's hand-written answer: Linear+ReLU pairs found in Sequentials (a nested one too),
    replaced through their container; outputs and gradients bit-identical, the ReLUs gone."""
    import copy

    from tinyscale.engine.compiled import LinearReLU, fuse_linear_relu

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), torch.nn.Linear(8, 2),
                                torch.nn.ReLU()).double()
    fused = copy.deepcopy(model)
    assert fuse_linear_relu(fused) == 3
    kinds = [type(m) for m in fused.modules()]
    assert kinds.count(LinearReLU) == 3 and torch.nn.ReLU not in kinds and kinds.count(torch.nn.Identity) == 3
    x = torch.randn(5, 4, dtype=torch.float64)
    model(x).sum().backward()
    fused(x).sum().backward()
    assert torch.equal(model(x), fused(x))
    for (name, p), q in zip(model.named_parameters(), fused.parameters()):
        assert torch.equal(p.grad, q.grad), name
