"""AutoTP: tensor parallelism for a model tinyscale did not write, found in its module tree.

DeepSpeed's AutoTP (`deepspeed.init_inference(..., replace_with_kernel_inject=False)`, and for
training `tensor_parallel.autotp_size`) and torch's `parallelize_module(model, mesh, plan)` both
turn a model's `nn.Linear` layers into Megatron's column- and row-parallel layers in place.
This is that, for training, on `tinyscale.tensor_parallel`'s layers:

    plan = find_plan(model, tp, tp_plan)     # {module name: style}; ValueError listing every problem
    apply_autotp(model, group, plan)         # in place, on the same full model on every rank

How the plan is found. Every module that holds a weight of two or more dims (a Linear, an
Embedding, transformers' Conv1D, ...) must be placed. The caller's `tp_plan` (module-name
pattern -> style, `fnmatch` patterns over the full dotted name, as torch's plans write
"layers.*.attention.wq") is read first, then `DEFAULT_PLAN`: the names the Llama family uses
(Llama, Mistral, Qwen2, ...; transformers' own `base_model_tp_plan` for them says the same) and
GPT-2's, which are also the projections of the attention and the MLP DeepSpeed's AutoTP looks for.

    style                   layer            split                       output
    colwise                 Linear, Conv1D   out_features (rows of W)    this rank's slice (heads, hidden units)
    rowwise                 Linear, Conv1D   in_features (columns of W)  summed over the ranks (Megatron's g)
    colwise_gather_output   nn.Linear        out_features, padded        gathered, padding dropped (the LM head)
    vocab                   nn.Embedding     vocab rows, padded          summed over the ranks
    replicate               anything         none                        the module runs whole on every rank

Head counts come from the model's own config (`num_attention_heads`, `num_key_value_heads`, the
first `config` in the module tree that has them) and the attention module's `head_dim`. A
colwise layer inside an attention module (a module with an int `head_dim`) is split by whole
heads: out_features H*D (queries) needs t | H; K*D (keys, values; GQA) needs t | K, or K | t, in
which case each K/V head is copied onto the t/K ranks whose query heads read it
(`kv_heads.ReplicatedKVLinear`). A projection (H + 2K)*D wide fuses q, k and v (GPT-2's
`c_attn`): each chunk is split by heads on its own (`fused.FusedColumnLinear`), which needs t | H
and t | K. transformers' `Conv1D` (GPT-2's layers, weight stored (in, out)) is split in its own
layout (`fused.py`). Then the attention module's per-rank counts are fixed up (`num_heads`,
`num_attention_heads`, `num_key_value_heads`, `num_key_value_groups`, GPT-2's `split_size`, where
it has them), so its reshape to (B, T, -1, D) and its `repeat_kv` work on the local shard.

What it refuses (ValueError listing every module by name, with the fix; the engine raises it as
one ConfigError before any process group exists):
- a weighted module no pattern places (add a `tp_plan` entry for it);
- a style on the wrong kind of module (colwise on an Embedding, vocab on a Linear, ...);
- a colwise layer whose parent has no rowwise layer (its sharded output would leave the region
  unsummed), and rowwise without colwise;
- head counts that t does not split (above), or that no config gives, and feature counts it
  does not divide;
- a shared (tied) weight split two different ways (a tied embedding and head are both split by
  vocab rows, `vocab` and `colwise_gather_output`: one shard, one Parameter, as in one process);
- dropout with p > 0 (an `nn.Dropout`, or an attention module's `attention_dropout`): such a model
  calls torch's dropout on each rank's shard with that rank's generator, which is never one
  process's masks (tinyscale's GPT draws its masks through `random.py` or from global
  coordinates); set the model's dropout to 0.
A `tp_plan` pattern that matches no module is refused too (a typo would otherwise do nothing).

Each colwise layer enters the region itself (f on its input: its backward all-reduces the input
gradient), so q, k and v cost three all-reduces in backward where the GPT's one pre-hook per
sub-layer costs one: the module's forward signature is the model's own, so AutoTP does not
hook it. The model keeps its state_dict keys (each rank's tensors are its shards);
`full_state_dict_from_tp` gathers the original ones. Run: `pytest -k autotp` (and `-k hf_llama`).
Lesson 12, "Module injection: AutoTP".
"""

from __future__ import annotations

import fnmatch
import math

import torch
import torch.distributed as dist
from torch import nn

from tinyscale.tensor_parallel.comm_ops import copy_to_region, gather_from_region
from tinyscale.tensor_parallel.fused import FusedColumnLinear, RowParallelConv1D, is_conv1d
from tinyscale.tensor_parallel.kv_heads import ReplicatedKVLinear
from tinyscale.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

STYLES = ("colwise", "rowwise", "colwise_gather_output", "vocab", "replicate")

# --8<-- [start:default-plan]
DEFAULT_PLAN = {  # the Llama family's names (transformers' base_model_tp_plan and _tp_plan say the same)
    "*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise", "*.o_proj": "rowwise",
    "*.gate_proj": "colwise", "*.up_proj": "colwise", "*.down_proj": "rowwise",
    "*embed_tokens": "vocab", "*lm_head": "colwise_gather_output",
    # GPT-2's: Conv1D layers, q, k and v fused in c_attn; the position table replicated
    "*.c_attn": "colwise", "*.c_fc": "colwise", "*.c_proj": "rowwise", "*.wte": "vocab", "*.wpe": "replicate",
}
# --8<-- [end:default-plan]
HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_key_value_groups")


def _features(layer: nn.Module) -> tuple[int, int]:
    """(in, out) of a Linear, or of a Conv1D (weight stored (in, out))."""
    return tuple(layer.weight.shape) if is_conv1d(layer) else (layer.in_features, layer.out_features)


def qkv_chunks(model: nn.Module, name: str, layer: nn.Module) -> list[int] | None:
    """The output chunks of a fused q/k/v projection inside an attention module ([H*D, K*D, K*D]);
    None for a layer that is one projection."""
    parent, counts = model.get_submodule(_parent(name)), head_counts(model)
    head_dim = getattr(parent, "head_dim", None)
    if not isinstance(head_dim, int) or counts is None:
        return None
    heads, kv_heads = counts
    if _features(layer)[1] == (heads + 2 * kv_heads) * head_dim:
        return [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    return None


def model_config(model: nn.Module):
    """The first `config` in the module tree that has `num_attention_heads` (the model's own)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and isinstance(getattr(config, "num_attention_heads", None), int):
            return config
    return None


def head_counts(model: nn.Module) -> tuple[int, int] | None:
    """(query heads H, K/V heads K) from the model's config; None if it has none."""
    config = model_config(model)
    if config is None:
        return None
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads


def _weighted(module: nn.Module) -> bool:
    """A module that holds a weight of two or more dims itself: it must be placed."""
    return any(p.dim() >= 2 for p in module.parameters(recurse=False))


def _style_of(name: str, tp_plan: dict[str, str]) -> tuple[str | None, str | None]:
    """(style, the pattern that chose it): the caller's plan first, then DEFAULT_PLAN."""
    for plan in (tp_plan, DEFAULT_PLAN):
        for pattern, style in plan.items():
            if fnmatch.fnmatchcase(name, pattern):
                return style, pattern
    return None, None


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _attention_problems(model: nn.Module, name: str, layer: nn.Linear, style: str, tp: int) -> list[str]:
    """A colwise or rowwise layer inside an attention module is split by whole heads."""
    parent = model.get_submodule(_parent(name))
    head_dim, counts = getattr(parent, "head_dim", None), head_counts(model)
    if not isinstance(head_dim, int):
        return []
    if counts is None:
        return [f"{name}: inside an attention module (head_dim={head_dim}), but the model has no config with "
                "num_attention_heads, so its heads cannot be kept whole: give the model its config, or place "
                "the attention's layers 'replicate' in parallel.tp_plan"]
    heads, kv_heads = counts
    width = _features(layer)[1 if style == "colwise" else 0]
    if style == "colwise" and qkv_chunks(model, name, layer) is not None:  # fused: every chunk split by heads
        if heads % tp or kv_heads % tp:
            return [f"{name}: q, k and v fused, with {heads} query and {kv_heads} K/V heads (config."
                    f"num_attention_heads, num_key_value_heads): tp={tp} must divide both (copying fused K/V heads "
                    f"is not built); choose parallel.tensor dividing {math.gcd(heads, kv_heads)}"]
        return []
    if width == heads * head_dim:
        if heads % tp:
            return [f"{name}: {heads} query heads (config.num_attention_heads) are not divisible by tp={tp}: "
                    f"choose parallel.tensor dividing {heads}"]
        return []
    if style == "colwise" and width == kv_heads * head_dim:
        if kv_heads % tp and tp % kv_heads:
            return [f"{name}: {kv_heads} K/V heads (config.num_key_value_heads) neither divisible by tp={tp} (split) "
                    f"nor dividing it (copied): choose parallel.tensor a multiple or a divisor of {kv_heads}"]
        return []
    return [f"{name}: {width} features inside an attention module with head_dim={head_dim} are neither "
            f"{heads} query heads nor {kv_heads} K/V heads (config.num_attention_heads, num_key_value_heads), so "
            "its heads cannot be told apart: place it with parallel.tp_plan ('replicate' with its whole module)"]


# --8<-- [start:find-plan]
def find_plan(model: nn.Module, tp: int, tp_plan: dict[str, str] | None = None) -> dict[str, str]:
    """{module name: style} for every weighted module of `model` over `tp` ranks (pure: no
    processes). Raises ValueError listing every module it cannot place, with the fix."""
    tp_plan = dict(tp_plan or {})
    bad_styles = [f"{p!r}: {s!r}" for p, s in tp_plan.items() if s not in STYLES]
    if bad_styles:
        raise ValueError(f"tp_plan styles must be one of {list(STYLES)}: got {', '.join(bad_styles)}")
    plan, used, unplaced, problems = {}, set(), [], []
    for name, module in model.named_modules():
        if not _weighted(module):
            continue
        style, pattern = _style_of(name, tp_plan)
        used.add(pattern)
        if style is None:
            unplaced.append(f"{name} ({type(module).__name__})")
            continue
        plan[name] = style
        wants = {"vocab": (nn.Embedding,), "replicate": (nn.Module,), "colwise_gather_output": (nn.Linear,)}.get(
            style, (nn.Linear, "Conv1D"))
        if not any(isinstance(module, w) if isinstance(w, type) else type(module).__name__ == w for w in wants):
            names = " or ".join(w if isinstance(w, str) else w.__name__ for w in wants)
            problems.append(f"{name}: style {style!r} (from {pattern!r}) needs a layer of type {names}; it is "
                            f"a {type(module).__name__}: place it with another style, or 'replicate', in "
                            "parallel.tp_plan")
            continue
        if style in ("colwise", "rowwise"):
            problems += _attention_problems(model, name, module, style, tp)
            width = _features(module)[1 if style == "colwise" else 0]
            if width % tp and not any(p.startswith(name + ":") for p in problems):
                side = "out_features" if style == "colwise" else "in_features"
                problems.append(f"{name}: {side}={width} is not divisible by tp={tp}: choose parallel.tensor "
                                f"dividing {width}, or place it 'replicate' with its partner layers")
        if style == "vocab" and (module.max_norm is not None or module.sparse or module.scale_grad_by_freq):
            problems.append(f"{name}: an Embedding with max_norm, sparse or scale_grad_by_freq: each rank would "
                            "see only its rows' counts and norms; place it 'replicate'")
    problems += _region_problems(plan) + _tie_problems(model, plan) + _dropout_problems(model)
    unused = [p for p in tp_plan if p not in used]
    if unused:
        problems.append(f"parallel.tp_plan patterns {unused} match no weighted module: fix the names "
                        f"(they match the full dotted name, e.g. {next(iter(plan), 'model.layers.0.mlp.up_proj')!r})")
    if unplaced:
        problems.insert(0, f"AutoTP cannot place {len(unplaced)} module(s): {', '.join(unplaced)}; add "
                           "parallel.tp_plan entries for them ({pattern: 'colwise' | 'rowwise' | "
                           "'colwise_gather_output' | 'vocab' | 'replicate'})")
    if problems:
        raise ValueError(f"tensor parallel (AutoTP, tp={tp}):\n  " + "\n  ".join(problems))
    return plan
# --8<-- [end:find-plan]


def _region_problems(plan: dict[str, str]) -> list[str]:
    """A colwise layer's sharded output must meet a rowwise sibling that sums it, and vice versa."""
    by_parent: dict[str, set[str]] = {}
    for name, style in plan.items():
        by_parent.setdefault(_parent(name), set()).add(style)
    out = []
    for parent, styles in by_parent.items():
        for have, needs in (("colwise", "rowwise"), ("rowwise", "colwise")):
            if have in styles and needs not in styles:
                names = [n for n, s in plan.items() if _parent(n) == parent and s == have]
                out.append(f"{', '.join(names)}: {have} with no {needs} layer beside it in {parent or 'the model'!r} "
                           f"(a tensor-parallel region is colwise layers, then one rowwise layer that sums their "
                           f"shards): give it a {needs} partner in parallel.tp_plan, or place it 'replicate'")
    return out


def _tie_problems(model: nn.Module, plan: dict[str, str]) -> list[str]:
    """A Parameter shared by placed modules must be split the same way in each (by vocab rows)."""
    owners: dict[int, list[str]] = {}
    for name in plan:
        for p in model.get_submodule(name).parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    out = []
    for names in (n for n in owners.values() if len(n) > 1):
        kinds = {"vocab" if plan[n] in ("vocab", "colwise_gather_output") else plan[n] for n in names}
        if len(kinds) > 1 or kinds == {"colwise"} or kinds == {"rowwise"}:
            out.append(f"{', '.join(names)} share a weight but are placed {[plan[n] for n in names]}: a tied weight "
                       "is split one way; tie an embedding ('vocab') to a head ('colwise_gather_output'), or "
                       "place both 'replicate'")
    return out


def _dropout_problems(model: nn.Module) -> list[str]:
    found = [f"{n} (p={m.p})" for n, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    found += [f"{n}.attention_dropout={m.attention_dropout}" for n, m in model.named_modules()
              if isinstance(getattr(m, "attention_dropout", None), float) and m.attention_dropout > 0]
    if not found:
        return []
    return [f"dropout {', '.join(found)}: under AutoTP each rank would draw masks over its own shard from its own "
            "generator, never one process's masks (tinyscale's GPT draws them through tensor_parallel/random.py); "
            "set the model's dropout to 0"]


class GatherOutputLinear(ColumnParallelLinear):
    """colwise_gather_output: a column-parallel layer (the vocab padded as the embedding's) whose
    logits are gathered and the padding dropped: (..., C) -> (..., O), for a model whose own
    forward computes the loss from full logits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x)  # (..., Op/t)
        return gather_from_region(local, self.group)[..., : self.out_features]  # (..., O)


class RegionKVLinear(ReplicatedKVLinear):
    """A K/V projection with its heads copied (K | t), entering the region itself (f on its input)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(copy_to_region(x, self.group))


def _split(model: nn.Module, name: str, module: nn.Module, style: str, group) -> nn.Module:
    tp = dist.get_world_size(group)
    if style == "vocab":
        return VocabParallelEmbedding.from_embedding(module, group)
    if style == "colwise_gather_output":
        return GatherOutputLinear.from_linear(module, group, pad_out_features=True)
    if style == "rowwise":
        return RowParallelConv1D(module, group) if is_conv1d(module) else RowParallelLinear.from_linear(module, group)
    chunks = qkv_chunks(model, name, module)
    if chunks is not None or is_conv1d(module):  # fused q/k/v, or a Conv1D (one chunk)
        return FusedColumnLinear(module, group, chunks or [_features(module)[1]])
    parent, counts = model.get_submodule(_parent(name)), head_counts(model)
    head_dim = getattr(parent, "head_dim", None)
    if isinstance(head_dim, int) and counts is not None:
        heads, kv_heads = counts
        if module.out_features == kv_heads * head_dim != heads * head_dim and kv_heads < tp:
            return RegionKVLinear(module, kv_heads, group)
    return ColumnParallelLinear.from_linear(module, group)


def _fix_head_counts(attention: nn.Module, heads: int, kv_heads: int, tp: int) -> None:
    """The attention module's per-rank head counts, for its reshape and repeat_kv on the shard."""
    local_heads, local_kv = heads // tp, max(kv_heads // tp, 1)  # K < t: one copied K/V head per rank
    local = {"num_heads": local_heads, "num_attention_heads": local_heads, "num_key_value_heads": local_kv,
             "num_key_value_groups": local_heads // local_kv}
    for attr in HEAD_COUNTS:
        if isinstance(getattr(attention, attr, None), int):
            setattr(attention, attr, local[attr])
    if getattr(attention, "split_size", None) == heads * attention.head_dim:  # GPT-2's split of fused q, k, v
        attention.split_size = local_heads * attention.head_dim


# --8<-- [start:apply]
def apply_autotp(model: nn.Module, group, plan: dict[str, str]) -> nn.Module:
    """Split `model` (the same full model on every rank) over the process group `group` by
    `plan` (from `find_plan`), in place; returns it. Keys, forward and loss stay the model's."""
    tp, counts = dist.get_world_size(group), head_counts(model)
    split: dict[int, nn.Parameter] = {}  # id(full weight) -> its shard: a tied weight is split once
    attentions = set()
    for name, style in plan.items():
        if style == "replicate":
            continue
        module = model.get_submodule(name)
        layer = _split(model, name, module, style, group)
        if id(module.weight) in split:  # tied to a layer split already (same rows): share its shard
            layer.weight = split[id(module.weight)]
        split.setdefault(id(module.weight), layer.weight)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, layer)
        if style in ("colwise", "rowwise") and isinstance(getattr(model.get_submodule(parent), "head_dim", None), int):
            attentions.add(parent)
    if counts is not None:
        for parent in attentions:
            _fix_head_counts(model.get_submodule(parent), *counts, tp)
    model.tp_group, model.sequence_parallel = group, False
    return model
# --8<-- [end:apply]
