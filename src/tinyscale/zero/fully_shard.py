"""ZeRO-3 the PyTorch way: `fully_shard(model)`, then any torch.optim optimizer on the shards.

    fully_shard(model, process_group=group)                 # model.parameters() are now shards
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)    # any optimizer, built afterwards
    model(x, y).backward(); opt.step(); opt.zero_grad()     # shards' .grad: averaged over ranks
    full = full_parameters(model)                           # {name: full tensor}, on every rank

Rajbhandari et al., "ZeRO" (2020), sec. 5.3 (P_os+g+p); the interface is PyTorch FSDP2's
(`torch.distributed.fsdp.fully_shard`, `MixedPrecisionPolicy`). Lesson: lessons/03-zero.md,
"ZeRO the PyTorch way". Run the tests: `pytest -k fully_shard`.

**Shards are plain tensors, not DTensors.** Each parameter is flattened, padded with zeros
to a multiple of N and cut into N equal pieces; rank r's piece (1-D, ceil(numel/N)
elements, the parameter's dtype) replaces the parameter in its module, under its name.
FSDP2 shards dim 0 and wraps the piece in a DTensor so that `full_tensor()`, DCP and
`clip_grad_norm_` know it is a piece; tinyscale's topics depend on torch and `dist` only
and show the layout bare: a flat slice, the same one `FlatUnit` draws. The price is that
anything that needs the whole parameter (a norm for clipping, a state_dict for another
world size) must gather it: `full_parameters` does. An elementwise optimizer (SGD, Adam,
AdamW) steps a flat shard exactly as it would step that slice of the full parameter.

**Units.** As `ZeroStage3` (`wrapped_module_names`, `assign_units`): one per wrapped module
(default: each element of each nn.ModuleList), plus the root for every other parameter; a
parameter held by two units (tied) belongs to the root. Frozen parameters are sharded too
(as FSDP2 does) and gathered with their unit, but get no gradient.

**Life of a unit, per forward call** (one all-gather of all its shards, `_GatherUnit`):
forward pre-hook gathers, puts the full tensors in the modules, casts floating inputs to
`param_dtype`; forward hook puts the shards back and frees the full tensors' storage
(reshard after forward; autograd's saved views keep no memory); the first gradient of
the call's outputs gathers again into the same storage; `_GatherUnit.backward` receives
the full gradients. A unit's gradients are reduce-scattered once all its calls have
them, in one order on every rank (the reverse of the order forwards first ran them);
units whose gradient never came are reduced at the end of backward, as zeros.

**Unused parameters.** Each reduce-scatter carries one usage count per parameter (in every
rank's row, so every rank gets the sum): a parameter no rank used keeps `.grad` None, so
the optimizer skips it, as torch does. Gradients accumulate into `.grad` across backward
calls until the optimizer's `zero_grad`, as torch's do.

**Mixed precision** (`MixedPrecisionPolicy`, FSDP2's): shards stay in their dtype (fp32
masters). The all-gather sends shards cast to `param_dtype`, so forward and backward run
in `param_dtype` (floating forward inputs cast too). Full gradients (in `param_dtype`) are
cast to `reduce_dtype` (default `param_dtype`) for the reduce-scatter, divided by N with
FSDP2's factors (fp32/bf16: sum, then / N; otherwise / pre before and / N/pre after the sum,
pre ~ sqrt(N), so an fp16 sum cannot overflow), then cast to the shard's dtype for `.grad`.

**Limits.** Every rank must run the same modules and use each module's outputs (the
gathers are collectives); recomputation (activation checkpointing) is not supported on
this path (the engine's stage 3 supports it). The collectives are stage 3's: an all-gather
per unit call in forward and again in backward, a reduce-scatter per unit per backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map

from tinyscale.dist import comm
from tinyscale.zero.stage3 import Wrap, assign_units, wrapped_module_names


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's policy: gather and compute in `param_dtype`, reduce gradients in `reduce_dtype`."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


def divide_factors(world_size: int, reduce_dtype: torch.dtype) -> tuple[float, float]:
    """(before, after) the sum: FSDP2's rule, so that our sums agree with its bit for bit."""
    if reduce_dtype in (torch.float32, torch.bfloat16):
        return 1.0, float(world_size)
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre


@dataclass
class _Param:
    """One parameter: its shard (what the optimizer sees) and where it lives in the model."""

    name: str
    shard: nn.Parameter
    shape: torch.Size
    numel: int
    chunk: int  # ceil(numel / N): shard length
    offset: int  # column in the unit's (N, C) gather buffer
    owners: list[tuple[nn.Module, str]]


@dataclass
class _Call:
    """One forward call of a unit: its full tensors, alive (storage) only while needed."""

    unit: int
    fulls: list[torch.Tensor]


# --8<-- [start:gather-unit]
class _GatherUnit(torch.autograd.Function):
    """Forward: all-gather a unit's shards into full tensors. Backward: hand the full
    gradients to the state, which reduce-scatters them into the shards' `.grad`."""

    @staticmethod
    def forward(ctx, state: FullyShardState, u: int, *shards):
        fulls = state.gather(u)
        ctx.state, ctx.u, ctx.n = state, u, len(shards)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        ctx.mark_non_differentiable(*[f for f, p in zip(fulls, state.units[u]) if not p.shard.requires_grad])
        return tuple(fulls)

    @staticmethod
    def backward(ctx, *grads):
        ctx.state.on_unit_grads(ctx.u, grads)
        return (None, None) + (None,) * ctx.n  # .grad is set by the reduce-scatter, not autograd
# --8<-- [end:gather-unit]


class FullyShardState:
    """The hooks and collectives of one `fully_shard`ed model (kept as `model._fully_shard`)."""

    def __init__(self, model: nn.Module, process_group, mp_policy: MixedPrecisionPolicy | None, wrap: Wrap):
        self.group = process_group
        self.world = dist.get_world_size(process_group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        self.mp = mp_policy or MixedPrecisionPolicy()
        names = wrapped_module_names(model, wrap)
        trainable_owner = assign_units(model, names)
        root = len(names)
        self.modules = [model.get_submodule(n) for n in names] + [model]
        frozen_owner = _frozen_units(model, names)
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for pname, p in module.named_parameters(recurse=False):
                owners.setdefault(id(p), []).append((module, pname))
        self.units: list[list[_Param]] = [[] for _ in self.modules]
        self.names = [n for n, _ in model.named_parameters()]
        for name, p in list(model.named_parameters()):  # deduplicated: a tied parameter once
            u = trainable_owner.get(id(p), frozen_owner.get(id(p), root))
            chunk = -(-p.numel() // self.world)
            flat = torch.zeros(chunk * self.world, dtype=p.dtype, device=p.device)
            flat[:p.numel()] = p.detach().reshape(-1)
            shard = nn.Parameter(flat[self.rank * chunk:(self.rank + 1) * chunk].clone(), requires_grad=p.requires_grad)
            offset = sum(q.chunk for q in self.units[u])
            param = _Param(name, shard, p.shape, p.numel(), chunk, offset, owners[id(p)])
            self.units[u].append(param)
            for module, pname in param.owners:
                module._parameters[pname] = shard
        self.calls: list[_Call] = []
        self.order: list[int] = []  # units in the order this forward first ran them
        self.forward_calls = [0] * len(self.units)
        self.backward_calls = [0] * len(self.units)
        self.grads: list[list[torch.Tensor | None]] = [[None] * len(ps) for ps in self.units]
        self.reduced: set[int] = set()
        self.next_reduce = 0
        self.in_backward = False
        for u, module in enumerate(self.modules):
            if self.units[u] or u == len(self.modules) - 1:
                module.register_forward_pre_hook(partial(self._before_forward, u))
                module.register_forward_hook(partial(self._after_forward, u))

    # --8<-- [start:collectives]
    def gather(self, u: int, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """All-gather unit u (one collective): each rank's shards side by side, (N, C)."""
        params = self.units[u]
        dtype = self.mp.param_dtype or params[0].shard.dtype
        send = torch.cat([p.shard.detach().to(dtype) for p in params])  # (C,)
        recv = torch.empty(self.world * send.numel(), dtype=dtype, device=send.device)  # (N * C,)
        if self.world > 1:
            comm.all_gather(recv, send, group=self.group)
        else:
            recv.copy_(send)
        table = recv.view(self.world, send.numel())  # row r: rank r's shards
        fulls = [table[:, p.offset:p.offset + p.chunk].reshape(-1)[:p.numel].view(p.shape) for p in params]
        if out is None:
            return [f.clone() for f in fulls]
        for o, f in zip(out, fulls):  # refill freed storage in place for backward
            o.untyped_storage().resize_(o.numel() * o.element_size())
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(o):
                o.copy_(f)
        return out

    @torch.no_grad()
    def reduce(self, u: int) -> None:
        """Reduce-scatter unit u's full gradients into its shards' `.grad` (averaged), with
        one usage count per parameter in every rank's row so that all ranks learn it."""
        params, grads = self.units[u], self.grads[u]
        dtype = self.mp.reduce_dtype or self.mp.param_dtype or params[0].shard.dtype
        width = sum(p.chunk for p in params)
        table = torch.zeros(self.world, width + len(params), dtype=dtype, device=params[0].shard.device)
        for j, (p, g) in enumerate(zip(params, grads)):
            if g is not None:
                padded = torch.zeros(self.world * p.chunk, dtype=dtype, device=table.device)
                padded[:p.numel] = g.reshape(-1)  # cast to reduce_dtype; padding stays 0
                table[:, p.offset:p.offset + p.chunk] = padded.view(self.world, p.chunk)  # (N, chunk)
                table[:, width + j] = 1  # used here
        before, after = divide_factors(self.world, dtype)
        if before != 1.0:
            table[:, :width].div_(before)
        out = torch.empty(width + len(params), dtype=dtype, device=table.device)
        if self.world > 1:
            comm.reduce_scatter(out, table.view(-1), group=self.group)
        else:
            out.copy_(table[0])
        if after != 1.0:
            out[:width].div_(after)
        for j, p in enumerate(params):
            if out[width + j] > 0:  # some rank used it; else .grad stays as it was (None)
                g = out[p.offset:p.offset + p.chunk].to(p.shard.dtype)
                p.shard.grad = g if p.shard.grad is None else p.shard.grad + g
        self.grads[u] = [None] * len(params)
        self.reduced.add(u)
    # --8<-- [end:collectives]

    def _before_forward(self, u: int, module: nn.Module, args):
        if self.in_backward:
            raise RuntimeError("fully_shard: a forward ran inside backward (activation checkpointing?); this "
                               "path does not support recomputation: use the engine's ZeRO stage 3 for that")
        if u == len(self.modules) - 1:  # the root: a new forward begins
            self._reset()
        if not self.units[u]:
            return None
        if u not in self.order:
            self.order.append(u)
        self.forward_calls[u] += 1
        fulls = _GatherUnit.apply(self, u, *[p.shard for p in self.units[u]])
        self.calls.append(_Call(u, list(fulls)))
        for p, f in zip(self.units[u], fulls):
            for owner, pname in p.owners:
                owner._parameters[pname] = f
        if self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            cast = self.mp.param_dtype
            return tree_map(lambda t: t.to(cast) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, args)
        return None

    def _after_forward(self, u: int, module: nn.Module, args, output) -> None:
        if not self.units[u]:
            return
        call = next(c for c in reversed(self.calls) if c.unit == u)
        for p in self.units[u]:
            for owner, pname in p.owners:
                owner._parameters[pname] = p.shard
        for f in call.fulls:
            f.untyped_storage().resize_(0)  # reshard after forward
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if outputs:
            register_multi_grad_hook(outputs, partial(self._before_backward, call), mode="any")

    def _before_backward(self, call: _Call, grad) -> None:
        if not self.in_backward:
            self.in_backward = True
            Variable._execution_engine.queue_callback(self._on_backward_end)
        if call.fulls and call.fulls[0].untyped_storage().nbytes() == 0:
            self.gather(call.unit, out=call.fulls)

    def on_unit_grads(self, u: int, grads) -> None:
        for j, g in enumerate(grads):
            if g is not None:
                self.grads[u][j] = g if self.grads[u][j] is None else self.grads[u][j] + g
        self.backward_calls[u] += 1
        for call in self.calls:
            if call.unit == u and self.backward_calls[u] == self.forward_calls[u]:
                for f in call.fulls:
                    f.untyped_storage().resize_(0)
        reverse = list(reversed(self.order))
        while self.next_reduce < len(reverse):
            v = reverse[self.next_reduce]
            if self.backward_calls[v] < self.forward_calls[v]:
                break
            self.reduce(v)
            self.next_reduce += 1

    def _on_backward_end(self) -> None:
        for v in list(reversed(self.order))[self.next_reduce:]:  # gradients that never came: zeros
            if any(p.shard.requires_grad for p in self.units[v]):
                self.reduce(v)
        self._reset()

    def _reset(self) -> None:
        for call in self.calls:
            for f in call.fulls:
                f.untyped_storage().resize_(0)
        self.calls, self.order, self.reduced, self.next_reduce = [], [], set(), 0
        self.forward_calls = [0] * len(self.units)
        self.backward_calls = [0] * len(self.units)
        self.grads = [[None] * len(ps) for ps in self.units]
        self.in_backward = False


def _frozen_units(model: nn.Module, names: list[str]) -> dict[int, int]:
    """id(param) -> unit for frozen parameters, by `assign_units`' rule (innermost wrapped
    module; held by two units: the root), which places trainable parameters only."""
    index, root, owner = {n: i for i, n in enumerate(names)}, len(names), {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        parts = module_name.split(".") if module_name else []
        prefixes = [".".join(parts[:k]) for k in range(len(parts), 0, -1)]
        u = next((index[q] for q in prefixes if q in index), root)
        for p in module.parameters(recurse=False):
            if not p.requires_grad:
                owner[id(p)] = u if owner.get(id(p), u) == u else root
    return owner


# --8<-- [start:fully-shard]
def fully_shard(module: nn.Module, *, process_group=None, mp_policy: MixedPrecisionPolicy | None = None,
                wrap: Wrap = None) -> nn.Module:
    """Shard `module`'s parameters over `process_group` in place (ZeRO-3); returns it.

    Afterwards `module.parameters()` are this rank's 1-D shards: build the optimizer on them.
    `wrap`: which submodules are units (module names or a predicate `wrap(name, module)`;
    default every element of every nn.ModuleList). Call it on every rank, with the same model.
    """
    if getattr(module, "_fully_shard", None) is not None:
        raise ValueError("fully_shard: this module is already sharded; call fully_shard once, on the root")
    if not any(True for _ in module.parameters()):
        raise ValueError(f"fully_shard: {type(module).__name__} has no parameters to shard")
    module._fully_shard = FullyShardState(module, process_group, mp_policy, wrap)
    return module
# --8<-- [end:fully-shard]


@torch.no_grad()
def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full, unpadded parameters keyed like the original `named_parameters()`, in their
    shards' dtype, on every rank (a collective: call it on every rank)."""
    state = getattr(model, "_fully_shard", None)
    if state is None:
        raise ValueError("full_parameters: the model was not sharded by tinyscale.zero.fully_shard")
    policy, state.mp = state.mp, MixedPrecisionPolicy()  # gather the masters, not a cast
    try:
        out = {}
        for u, params in enumerate(state.units):
            if params:
                for p, full in zip(params, state.gather(u)):
                    out[p.name] = full
    finally:
        state.mp = policy
    return {n: out[n] for n in state.names}
