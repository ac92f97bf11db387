"""Automatic fusion: `torch.compile` of the GPT's blocks (`compile: {"enabled": true}`, issue 28, DS-31).

    {"compile": {"enabled": true, "backend": "inductor", "compile_kwargs": {"mode": "default"}}}
    {"compile": true}                                   # the same, with those defaults

    engine = ts.initialize(model, config)   # each block's forward compiled, lazily, at its first call

`backend` and `compile_kwargs` are the arguments of DeepSpeed's `engine.compile(backend=...,
compile_kwargs=...)` (`torch.compile(module, backend=backend, **compile_kwargs)`); `enabled` is
tinyscale's own (DeepSpeed compiles when the script calls `engine.compile()`; the DeepSpeed API
here has that method too, `tinyscale.deepspeed`). DeepSpeed's own `compile` keys (`deepcompile`,
`passes`, ...) drive DeepCompile, its graph passes that move ZeRO's gathers and reduce-scatters
into the compiled graph; they are noted (no effect here).

What is compiled: each block's `forward`, set as an instance attribute over the class's (the
same Block object: parameters, state and hooks stay). Every block runs the same code, so Dynamo
keeps one cache entry for `Block.forward`'s code object, and it lifts the parameters into graph
inputs, guarded on their shapes and dtypes, not on which block holds them: the second block
reuses the first block's graph, forward and backward (`compiled_graphs()` counts them;
`pytest -k torch_compile` checks one graph for all blocks). What stays eager: the embedding, the
final norm, the head and the loss, and every module hook around a block, so DDP's and ZeRO's
gradient hooks and ZeRO-3's gather and release hooks run as without compilation.

It composes with (each trained equal to eager and to one process in float64,
`tests/engine/test_torch_compile.py`): data parallelism, ZeRO 1-3 over dp, tensor and sequence
parallelism, the pipeline, context parallelism, counter dropout, an MoE GPT, every activation
checkpointing policy, and clipping, weight decay, accumulation, a tied embedding and GQA.

Collectives (tensor and context parallelism) and the MoE's routing break a block's graph: Dynamo
runs them eagerly between compiled pieces, so a block is several graphs, still one cache entry
shared by every block. Neither refused nor tested here: fp16 and bf16, expert parallelism,
pipeline schedules other than 1f1b, and compile_kwargs other than the defaults.

Activation checkpointing inside a compiled block (policies full, every_k, selective): Dynamo is
tracing the block when the policy's `checkpoint()` runs, and there `checkpoint()` calls torch's
non-reentrant checkpoint (`tinyscale.checkpointing.api.compiled_checkpoint`), which Dynamo traces
as a higher-order op: every op of the checkpointed region is tagged "recompute" in AOTAutograd's
joint graph, so the compiled forward keeps only the region's inputs and the compiled backward
runs the region's ops again before the gradients that need them. Ours cannot be traced (its
saved-tensor hooks run Python at each unpack; the compiled backward saved its own tensors and
the recomputation found no inputs: StopIteration). What is kept and redone is the policy's, as
eagerly (`pytest -k torch_compile_checkpointing`, one process, attention "math"): `full` keeps
the same bytes (the blocks' inputs), `selective` keeps no (B, H, T, T) tensor, and the same
softmaxes run again in backward; the compiled backward skips each region's last matmul (the
MLP's down projection, the attention's P v), whose output no gradient needs, as torch's eager
checkpoint's early stop does (and, since then, ours: `tinyscale.checkpointing`'s `early_stop=True`). Random ops rerun in the backward graph get the
generator state they had in the forward (saved beside the inputs, one CPU state of 5,056 bytes
per random op: eagerly the checkpoint keeps one per region, outside autograd), so stream
dropout's masks are replayed (with inductor: `fallback_random`, as below).
`use_reentrant` has no effect there: the compiled checkpoint is the non-reentrant one (Dynamo
traces no other); the policy's `generators` are not replayed (refused below where one draws).
Refused (`check_layout`), each with its reason:

- a model that is not tinyscale's GPT: its blocks are not known (compile them yourself, e.g.
  `for layer in model.model.layers: layer.compile()`, before `ts.initialize`);
- stream dropout (GPTConfig.dropout > 0, dropout_masks "stream") with backend inductor, unless
  `compile_kwargs.options.fallback_random` is true: inductor draws the random numbers inside its
  fused kernel (Philox), not from torch's generator, so the masks differ from eager's (measured:
  the loss differs by 5e-4 at the first step); with fallback_random it draws torch's, and trains
  like eager and one process. Counter masks are hashed from the dropout clock by torch ops and
  need nothing;
- `activation_checkpointing.partition_activations` or `cpu_checkpointing` with a checkpointing
  policy: both are saved-tensor hooks around the checkpoint (checkpointing/saved_inputs.py) that
  should see its inputs only. Dynamo does not trace `saved_tensors_hooks` (it breaks the block's
  graph there), so the hook wraps the compiled checkpoint, and what that saves passes through it:
  measured, 13 tensors per block (its input, the two RoPE tables, the block's 9 parameters and
  a generator state) where eagerly 3 pass; the parameters would be split over tp or copied to
  the host at every step;
- policies full and every_k with tensor or context parallelism or an MoE GPT: the checkpointed
  block then holds collectives (TP's all-reduces, the ring's exchanges) or the MoE's data-dependent
  routing, each a graph break, and a checkpoint's region is one higher-order op, which cannot
  break: Dynamo gives up on the whole block (measured: 0 graphs compiled with tp 2 + SP, with cp 2
  and with the MoE GPT; with `selective` instead, 14, 4 and 13). `selective` composes with them:
  its core holds no collective under tp, and under cp the core's ring exchanges break the graph
  with or without checkpointing, so the core runs eagerly (trained equal in `--thorough`);
- tensor parallelism's tracker dropout (parallel.tensor > 1, tensor_dropout "tracker",
  GPTConfig.dropout > 0, masks "stream") with a checkpointing policy: the sharded activations draw
  from the RNG tracker's own torch.Generator (tensor_parallel/random.py), which eager checkpoints
  replay (`generators`), but the compiled recomputation restores only torch's default generator
  (run_with_rng_state), so a recomputed mask is a new one (measured, tp 2 selective: the loss off
  by 1.8e-4 at step 1, 1.5e-3 at step 3). The exact mode draws from torch's default generator, and
  trains like eager (measured: equal losses; `--thorough`); counter masks need no generator.
"""

from __future__ import annotations

import torch
from torch import nn

from tinyscale.config import CompileConfig, ConfigError, EngineConfig

FIELD = "compile.enabled"


def check_layout(config: EngineConfig, model: nn.Module, world_size: int = 1, mesh=None) -> None:
    """Refuse what compiled blocks cannot serve, naming the field and the reason (no collectives)."""
    if not config.compile.enabled:
        return
    from tinyscale.models.gpt import GPT  # noqa: PLC0415 (the models import the engine's pieces)

    problems = []
    if not isinstance(model, GPT):
        raise ConfigError(f"{FIELD}: tinyscale compiles the blocks of its own GPT, and a {type(model).__name__}'s "
                          "blocks are not known; compile your model's layers yourself before ts.initialize "
                          "(e.g. `for layer in model.model.layers: layer.compile()`), or set compile.enabled false")
    cfg, options = model.config, config.compile.compile_kwargs.get("options") or {}
    if (cfg.dropout > 0 and cfg.dropout_masks == "stream" and config.compile.backend == "inductor"
            and not options.get("fallback_random")):
        problems.append(f"{FIELD} with GPTConfig.dropout={cfg.dropout} (stream masks) and backend 'inductor': "
                        "inductor draws dropout's random numbers itself, inside the fused kernel, so the masks "
                        "differ from the eager run's; set compile.compile_kwargs.options.fallback_random true "
                        "(torch's generator, as eager), or GPTConfig.dropout_masks 'counter'")
    ac = config.activation_checkpointing
    if ac.policy in ("full", "every_k", "selective"):  # checkpoints inside the compiled blocks (docstring)
        for option in ("partition_activations", "cpu_checkpointing"):
            if getattr(ac, option):
                problems.append(f"{FIELD} with activation_checkpointing.{option}=true: it is a saved-tensor hook "
                                "on the checkpoint's inputs, which Dynamo does not trace, so it would act on all "
                                "that the compiled checkpoint saves (the block's parameters too); set it false, "
                                "or compile.enabled false")
        breaks = [what for what, on in (("parallel.tensor", config.parallel.tensor > 1),
                                        ("parallel.context", config.parallel.context > 1),
                                        ("an MoE GPT", bool(getattr(cfg, "moe_experts", 0)))) if on]
        if ac.policy != "selective" and breaks:
            problems.append(f"{FIELD} with activation_checkpointing.policy={ac.policy!r} and {', '.join(breaks)}: a "
                            "checkpointed block then holds collectives or the MoE's data-dependent routing, which "
                            "break Dynamo's graph, and a checkpoint's region must be one graph, so Dynamo compiles "
                            "none of the block (measured: 0 graphs); use policy 'selective' (its core has no "
                            "collective under tensor parallelism) or compile.enabled false")
        if (config.parallel.tensor > 1 and config.parallel.tensor_dropout == "tracker" and cfg.dropout > 0
                and cfg.dropout_masks == "stream"):
            problems.append(f"{FIELD} with activation_checkpointing.policy={ac.policy!r} and parallel.tensor_dropout="
                            f"'tracker' (GPTConfig.dropout={cfg.dropout}, stream masks): the compiled "
                            "recomputation replays torch's default generator only, not the RNG tracker's, so "
                            "recomputed masks differ (measured: loss off by 1.8e-4 at step 1); set "
                            "parallel.tensor_dropout 'exact' or GPTConfig.dropout_masks 'counter'")
    if problems:
        raise ConfigError("\n".join(problems))


def _blocks(model: nn.Module) -> list[nn.Module]:
    """This rank's GPT blocks (a pipeline stage's model keeps stand-ins for the others')."""
    from tinyscale.models.gpt import Block  # noqa: PLC0415

    return [b for b in model.blocks if isinstance(b, Block)]


# --8<-- [start:compile-blocks]
def compile_blocks(model: nn.Module, section: CompileConfig) -> nn.Module:
    """Each GPT block's forward compiled in place (lazily: the first call compiles); the model's
    other modules and every hook stay eager. Nothing without compile.enabled (the config's section,
    as the layout plan carries it)."""
    if not section.enabled:
        return model
    options = dict(section.compile_kwargs)
    for block in _blocks(model):
        # The bound method of the class's forward: one code object for every block, so one cache
        # entry, whose graph takes the block's parameters as inputs (guards on their shapes only).
        block.forward = torch.compile(block.forward, backend=section.backend, **options)
    return model
# --8<-- [end:compile-blocks]


def compiled_graphs(model: nn.Module) -> dict[str, int]:
    """Dynamo's counts: 'graphs', the graphs compiled in this process (forward pieces; a graph
    break splits a block into several), and 'block_entries', the compiled entries cached for the
    blocks' forward: 1 when every block reuses the first block's compilation (each recompile,
    a guard failing for another block or another call, adds one)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # noqa: PLC0415
    from torch._dynamo.utils import counters  # noqa: PLC0415

    code = type(_blocks(model)[0]).forward.__code__
    return {"graphs": counters["stats"]["unique_graphs"], "block_entries": len(_debug_get_cache_entry_list(code))}


# --8<-- [start:fuse-by-pattern]
class LinearReLU(nn.Module):
    """Linear then ReLU as one module: relu(x W^T + b), the pair a pattern-matching pass fuses.
    (On a GPU, one GEMM whose epilogue applies the ReLU; here the two calls, so the test is exact.)"""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear  # the same Parameters: nothing copied, the optimizer still holds them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def fuse_linear_relu(model: nn.Module) -> int:
    """Replace each Linear directly followed by a ReLU inside an nn.Sequential with one LinearReLU,
    and the ReLU with an Identity; returns how many pairs were fused. The pairs are collected first
    (a list of (container, index)), then replaced through their container: nothing is swapped
    while named_modules() is walking the tree, and the ReLU goes, or it would run twice."""
    pairs = [(seq, i) for seq in model.modules() if isinstance(seq, nn.Sequential)
             for i in range(len(seq) - 1) if type(seq[i]) is nn.Linear and type(seq[i + 1]) is nn.ReLU]
    for seq, i in pairs:
        seq[i], seq[i + 1] = LinearReLU(seq[i]), nn.Identity()
    return len(pairs)
# --8<-- [end:fuse-by-pattern]
