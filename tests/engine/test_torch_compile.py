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

Activation checkpointing inside the compiled blocks (`-k torch_compile_checkpointing`): dp 2 at
ZeRO 3 with full, and one process with every_k and stream dropout, train equal to eager and one
process (default); what each policy keeps and reruns is measured eagerly and compiled, on one
process (default); the whole regions the "eager" backend reruns, tp 2 + SP selective, tp 2
selective with exact stream dropout, pp 2 every_k, cp 2 selective, selective with counter
dropout, and inductor with full and selective under `--thorough`, with the measurement behind refusing the saved-tensor-hook options.

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
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tinyscale as ts
from tinyscale import ConfigError
from tinyscale.checkpointing import apply_policy, saved_tensors
from tinyscale.config import CompileConfig
from tinyscale.data import synthetic_token_batches
from tinyscale.engine.compiled import compile_blocks, compiled_graphs
from tinyscale.engine.plan import plan_layout
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
    # activation checkpointing inside the compiled blocks (torch's checkpoint, traced as a higher-order op)
    "dp2-zero3-full": (2, {}, 3, {}, {"activation_checkpointing": {"policy": "full"}}),
    "every-k-stream-dropout": (1, {}, 0, {"n_layer": 3, "dropout": 0.1},
                               {"activation_checkpointing": {"policy": "every_k", "every_k": 2}}),
    "selective-counter-dropout": (1, {}, 0, {"dropout": 0.1, "dropout_masks": "counter"},
                                  {"activation_checkpointing": {"policy": "selective"}}),
    "tp2-sp-selective": (2, {"tensor": 2, "sequence_parallel": True}, 0, {},
                         {"activation_checkpointing": {"policy": "selective"}}),
    # tp's exact stream dropout: every mask drawn from torch's default generator, which the compiled
    # recomputation replays (the tracker mode draws from its own: refused)
    "tp2-selective-exact-dropout": (2, {"tensor": 2}, 0, {"dropout": 0.1},
                                    {"activation_checkpointing": {"policy": "selective"}}),
    "pp2-every-k": (2, {"pipeline": 2}, 1, {"n_layer": 4}, {"activation_checkpointing": {"policy": "every_k",
                                                                                        "every_k": 2}}),
    "cp2-selective": (2, {"context": 2}, 2, {}, {"activation_checkpointing": {"policy": "selective"}}),
    "full-inductor": (1, {}, 0, {"dropout": 0.1}, {"activation_checkpointing": {"policy": "full"},
                                                   "compile_kwargs": {"options": {"fallback_random": True}}}),
    "selective-inductor": (1, {}, 0, {}, {"activation_checkpointing": {"policy": "selective"}}),
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


DEFAULT_DP2 = ("dp2-zero3", "dp2-zero3-full")  # one pooled 2-rank call for both tests


def test_torch_compile_aot_eager_under_zero3_hooks_trains_like_eager_and_one_process():
    check_layout(2, DEFAULT_DP2, "dp2-zero3", "aot_eager")


def test_torch_compile_checkpointing_full_under_zero3_hooks_trains_like_eager_and_one_process():
    """Checkpointed compiled blocks whose parameters ZeRO 3 frees after the forward: the compiled
    backward's recomputation runs after the backward gather hook refilled them."""
    check_layout(2, DEFAULT_DP2, "dp2-zero3-full", "aot_eager")


def test_torch_compile_checkpointing_every_k_replays_stream_dropout_like_eager():
    """every_k (block 1 of 3) with stream dropout: the compiled recomputation draws the forward's
    masks from the generator state it saved, and the plain blocks beside it draw theirs in order."""
    check_layout(1, ("every-k-stream-dropout",), "every-k-stream-dropout", "aot_eager")


class _BackwardOps(TorchDispatchMode):
    """Counts the ATen ops a backward runs, by name (a higher-order op, such as the random op that
    a compiled backward reruns under run_with_rng_state, by its own name)."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.matmul_flops = 0  # 2mkn per (m, k) @ (k, n), FlopCounterMode's convention (it rejects the rng op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name() if isinstance(func, torch._ops.HigherOrderOperator) else func.overloadpacket.__name__
        self.counts[name] += 1
        if name in ("mm", "bmm"):
            self.matmul_flops += 2 * args[0].shape[:-1].numel() * args[0].shape[-1] * args[1].shape[-1]
        return func(*args, **(kwargs or {}))


def _kept_and_redone(policy: str, compiled: bool, backend: str = "aot_eager") -> tuple[list, _BackwardOps]:
    """A 2-block GPT with `policy` (every_k 2: block 1), eager or compiled (aot_eager): the tensors
    its forward keeps for backward (parameters left out), and the ops its backward runs (and their
    matmul FLOPs)."""
    torch._dynamo.reset()
    model = apply_policy(gpt(attn_impl="math"), policy, every_k=2 if policy == "every_k" else None)
    compile_blocks(model, CompileConfig(enabled=compiled, backend=backend))
    idx, targets = next(iter(batches()))
    rows = saved_tensors(model, idx, targets)
    loss, mode = model(idx, targets), _BackwardOps()
    with mode:
        loss.backward()
    return rows, mode


def test_torch_compile_checkpointing_keeps_and_recomputes_what_eager_does():
    """Each policy means in a compiled block what it means eagerly: the same tensors kept (bytes),
    the same attention cores (softmaxes) rerun in backward, and the same matmuls rerun but each
    region's last one (the MLP's down projection, the core's P v), whose output no gradient needs:
    the compiled backward leaves it out, as our eager checkpoint's early stop does; the rerun matmul
    FLOPs are the HFU formula's (tinyscale.mfu, early_stop=True) both ways."""
    from tinyscale.mfu import forward_flops

    modes = {(policy, compiled): _kept_and_redone(policy, compiled)
             for policy in ("none", "full", "every_k", "selective") for compiled in (False, True)}
    got = {key: (rows, mode.counts) for key, (rows, mode) in modes.items()}
    flops = forward_flops(gpt(attn_impl="math").config, SEQ)
    recompute = {"full": ("full", None), "every_k": ("full", 1), "selective": ("selective", None)}
    for (policy, compiled), (_, mode) in modes.items():
        rerun = mode.matmul_flops - modes[("none", compiled)][1].matmul_flops
        assert rerun == ROWS * flops.recomputed(*recompute.get(policy, ("none", None))), (policy, compiled)

    def nbytes(rows):
        return sum({row.storage_key: row.storage_bytes for row in rows}.values())

    def probabilities(rows):  # (B, H, T, T): Korthikanti's 5as/h part, what selective recomputes
        return [row for row in rows if len(row.shape) == 4 and row.shape[-2:] == (SEQ, SEQ)]

    def matmuls(counts):
        return counts["mm"] + counts["bmm"]

    regions = {"full": 2, "every_k": 1, "selective": 2}  # checkpointed blocks / attention cores
    per_region = {"full": 9, "every_k": 9, "selective": 2}  # a block's forward: 7 mm + 2 bmm; a core's: 2 bmm
    for compiled in (False, True):
        none_rows, none_ops = got[("none", compiled)]
        assert probabilities(none_rows) and none_ops["_softmax"] == 0
        for policy, n in regions.items():
            rows, ops = got[(policy, compiled)]
            assert ops["_softmax"] == n, (policy, compiled, ops)
            redone = matmuls(ops) - matmuls(none_ops)
            assert redone == n * per_region[policy] - n, (policy, compiled, redone)
            assert not any(row.dtype == torch.uint8 for row in rows)  # no random op: no generator state kept
        assert not probabilities(got[("selective", compiled)][0])
        full, every_k, none = (nbytes(got[(p, compiled)][0]) for p in ("full", "every_k", "none"))
        assert 2 * every_k == full + none  # block 1 keeps what full keeps, block 0 what none keeps
    assert nbytes(got[("full", True)][0]) == nbytes(got[("full", False)][0]) < nbytes(got[("none", True)][0]) / 3


@pytest.mark.thorough
def test_torch_compile_checkpointing_eager_backend_reruns_whole_regions():
    """Backend "eager" (Dynamo's graph run as it is, no AOTAutograd partitioner): torch's
    checkpoint reruns every matmul of each region, so the engine's HFU counts it with
    early_stop=False (engine/throughput.py: early_stop_of)."""
    from tinyscale.config import EngineConfig
    from tinyscale.engine.throughput import early_stop_of
    from tinyscale.mfu import forward_flops

    flops = forward_flops(gpt(attn_impl="math").config, SEQ)
    none = _kept_and_redone("none", True, "eager")[1].matmul_flops
    engine_config = EngineConfig.load({"train_batch_size": ROWS, "compile": {"enabled": True, "backend": "eager"}})
    early_stop = early_stop_of(engine_config, tp=1)
    assert early_stop is False
    for policy in ("full", "selective"):
        rerun = _kept_and_redone(policy, True, "eager")[1].matmul_flops - none
        assert rerun == ROWS * flops.recomputed(policy, early_stop=early_stop), policy


THOROUGH_AOT = ("tp2-sp", "pp2", "cp2", "dp2-counter-dropout", "dp2-offload-checkpointing", "tp2-sp-selective",
                "pp2-every-k", "cp2-selective", "tp2-selective-exact-dropout")


@pytest.mark.thorough
def test_torch_compile_checkpointing_selective_with_counter_dropout_trains_like_eager():
    check_layout(1, ("selective-counter-dropout",), "selective-counter-dropout", "aot_eager")


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


INDUCTOR_CHECKPOINTING = ("full-inductor", "selective-inductor")


@pytest.mark.thorough
@pytest.mark.parametrize("name", INDUCTOR_CHECKPOINTING)
def test_torch_compile_checkpointing_inductor_trains_like_eager(name):
    check_layout(1, INDUCTOR_CHECKPOINTING, name, "inductor")


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


def test_torch_compile_refuses_checkpoint_input_hooks_tp_stream_dropout_and_inductor_stream_dropout_by_name():
    for option in ("cpu_checkpointing", "partition_activations"):
        section = {"policy": "full", option: True}
        with pytest.raises(ConfigError) as err:  # partition_activations needs tp > 1 (the config's own check)
            plan_layout(ts.EngineConfig.load(config({"tensor": 2}, backend="aot_eager",
                                                    activation_checkpointing=section)), gpt(), world_size=2)
        assert f"compile.enabled with activation_checkpointing.{option}=true" in str(err.value)
        assert "Dynamo does not trace" in str(err.value)
    with pytest.raises(ConfigError) as err:
        plan_layout(ts.EngineConfig.load(config({"tensor": 2, "tensor_dropout": "tracker"}, backend="aot_eager",
                                                activation_checkpointing={"policy": "selective"})),
                    gpt(dropout=0.1), world_size=2)
    message = str(err.value)
    assert "activation_checkpointing.policy='selective' and parallel.tensor_dropout='tracker'" in message
    assert "'exact'" in message and "'counter'" in message
    # accepted: counter masks under tp, the exact mode (torch's generator), stream masks in one process
    for parallel, masks in (({"tensor": 2}, "counter"), ({"tensor": 2}, "stream"), ({}, "stream")):
        plan_layout(ts.EngineConfig.load(config(parallel, backend="aot_eager",
                                                activation_checkpointing={"policy": "selective"})),
                    gpt(dropout=0.1, dropout_masks=masks), world_size=2 if parallel else 1)
    # a whole block checkpointed over collectives or the MoE's routing: no graph at all (selective is served)
    for parallel, model, what in (({"tensor": 2}, gpt(), "parallel.tensor"), ({"context": 2}, gpt(), "parallel.context"),
                                  ({}, gpt(moe_experts=4, moe_top_k=2), "an MoE GPT")):
        for policy in ("full", "every_k"):
            section = {"policy": policy} | ({"every_k": 2} if policy == "every_k" else {})
            with pytest.raises(ConfigError) as err:
                plan_layout(ts.EngineConfig.load(config(parallel, backend="aot_eager", activation_checkpointing=section)),
                            model, world_size=2 if parallel else 1)
            assert f"activation_checkpointing.policy={policy!r} and {what}" in str(err.value)
            assert "0 graphs" in str(err.value)
    message = _refusal(gpt(dropout=0.1))
    assert "compile.enabled" in message and "dropout" in message and "fallback_random" in message
    with pytest.raises(ConfigError, match="compile.enabled: tinyscale compiles the blocks of its own GPT"):
        ts.initialize(torch.nn.Sequential(torch.nn.Linear(2, 2)), config(backend="inductor"))


@pytest.mark.thorough
def test_torch_compile_checkpointing_input_hooks_would_see_the_parameters(monkeypatch):
    """The measurement behind refusing partition_activations / cpu_checkpointing: the hook around a
    checkpoint sees its input and the RoPE tables eagerly (3 tensors per block), and, compiled, all
    that the compiled checkpoint saves: the block's 9 parameters and a generator state too (13)."""
    from tinyscale.checkpointing import saved_inputs

    packed: list[tuple] = []
    pack = saved_inputs.keep_inputs._pack
    monkeypatch.setattr(saved_inputs.keep_inputs, "_pack", lambda self, t: packed.append(t.dtype) or pack(self, t))
    counts = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        packed.clear()
        model = apply_policy(gpt(), "full", inputs_to_host=True)
        compile_blocks(model, CompileConfig(enabled=compiled, backend="aot_eager"))
        model(*next(iter(batches()))).backward()
        counts[compiled] = (len(packed), packed.count(torch.uint8))
    assert counts == {False: (2 * 3, 0), True: (2 * 13, 2)}, counts


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
