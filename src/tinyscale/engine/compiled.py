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
parallelism, the pipeline, context parallelism, counter dropout, an MoE GPT, the offload
checkpointing policy, and clipping, weight decay, accumulation, a tied embedding and GQA.
Collectives (tensor and context parallelism) and the MoE's routing break a block's graph: Dynamo
runs them eagerly between compiled pieces, so a block is several graphs, still one cache entry
shared by every block. Neither refused nor tested here: fp16 and bf16, expert parallelism,
pipeline schedules other than 1f1b, and compile_kwargs other than the defaults.
Refused (`check_layout`), each with its reason:

- a model that is not tinyscale's GPT: its blocks are not known (compile them yourself, e.g.
  `for layer in model.model.layers: layer.compile()`, before `ts.initialize`);
- stream dropout (GPTConfig.dropout > 0, dropout_masks "stream") with backend inductor, unless
  `compile_kwargs.options.fallback_random` is true: inductor draws the random numbers inside its
  fused kernel (Philox), not from torch's generator, so the masks differ from eager's (measured:
  the loss differs by 5e-4 at the first step); with fallback_random it draws torch's, and trains
  like eager and one process. Counter masks are hashed from the dropout clock by torch ops and
  need nothing;
- activation checkpointing policies full, every_k and selective: tinyscale's checkpoint keeps its
  inputs through saved-tensor hooks, and AOTAutograd's compiled backward saves its own tensors, so
  the recomputation finds no inputs (StopIteration at the first backward). A compiled block
  chooses what it saves for backward itself: AOTAutograd's min-cut partitioner recomputes cheap
  pointwise ops, and `torch._functorch.config.activation_memory_budget` trades more.
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
    policy = config.activation_checkpointing.policy
    if policy in ("full", "every_k", "selective"):
        problems.append(f"{FIELD} with activation_checkpointing.policy={policy!r}: tinyscale's checkpoint keeps "
                        "its inputs through saved-tensor hooks, which the compiled backward replaces by the "
                        "tensors it saves itself, so the recomputation finds no inputs; a compiled block chooses "
                        "what it saves (AOTAutograd recomputes cheap ops): set the policy 'none' or 'offload'")
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
