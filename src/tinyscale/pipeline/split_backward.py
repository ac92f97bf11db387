"""Zero-bubble's split of a stage's backward: B (the input gradient) now, W (the weights') later,
with no backward node run in both but the ones that hold a parameter's edge.

    grad_x, kept = backward_input(out, grad_out, x, params)   # B: x's gradient; `kept` is what W needs
    backward_weight(kept)                                      # W: adds each parameter's gradient to .grad

B walks the graph from `out` to `x`. Every node on that walk that also has an edge towards a
parameter (a matmul's backward with the weight as an input, a norm's scale) is an *intermediate*:
B records the gradient arriving at it (a pre-hook), and autograd computes there only the input
side (the engine asks each node for the outputs its walk needs). W starts at those nodes
(the autograd engine run from their `GradientEdge`s with the recorded gradients) and walks only
towards the parameters, so each intermediate computes its weight side only, and nothing between
`out` and the intermediates (an attention's backward, an MoE layer's all-to-alls) runs again.
The same cut torch's zero-bubble stage makes (torch/distributed/pipelining/_backward.py).

Parameters are grouped by the intermediates they share (a weight used twice has two; so does a
weight used by two nodes); W runs the engine once per group, groups in reverse parameter order (as
a plain backward reaches them; the same on every rank: a collective on a parameter's side, ZeRO 3
style, stays matched). A group whose
intermediates lie on one path (a weight used at the stage's top and its bottom) walks that path
again in W, each intermediate fed its recorded gradient (a pre-hook replaces what arrives), so the
result is exact; only such a stage pays. Frozen parameters are not passed; an unused one gets no
gradient (as `allow_unused`). A parameter's tensor hooks (`register_hook`) shape its gradient as in
a plain backward. Its post-accumulate-grad hooks run as in a plain backward too: once per W that
reached it, after its group's gradients are in .grad, and the whole W is one backward for the
engine (`in_one_backward`), so what a hook queues for the end of backward (BucketedDDP's and
ZeRO's flush) runs once, after the last group. W writes .grad itself, not through AccumulateGrad
(which would apply the tensor hooks a second time), so it calls the hooks itself, read from where
torch keeps them (`post_accumulate_grad_hooks`, private; a test fails if torch moves them).

Time: no operator runs in both B and W; what they cost beyond one backward (1.49 times it on
stage 1 of notebook 08's GPT, one micro-batch, 1.74 before W accumulated in place) is host work:
B's walk of the graph and W's engine call per group, about 50 us each on that CPU (lesson 08).

Memory between B and W: `Kept` holds the intermediates, and through their next_functions the
graph below the topmost of them, with its saved tensors (what only B needed among them too: the
attention's, as when W walked from `out`; only the nodes above every intermediate, the head's
loss on the last stage, are freed when B returns), plus the gradients B saw arrive at each
intermediate, (N, out) for a linear layer, where the full walk kept one output gradient.
Measured on a middle stage of 3 blocks (C 16, N 16, float64): 32,000 B saved either way, and
18,432 B of arriving gradients instead of 2,048 B of output gradient (`-k split_backward_keeps`).
Zero-bubble's W needs those gradients (ZB paper, sec. 2); the saved tensors only B needed could go.

Test: `pytest tests/pipeline -k split_backward` (float64 against a plain backward; FLOPs of B, W);
`pytest tests/pipeline -k zb_hooks` (the hooks; BucketedDDP and ZeRO 2 over ZB-H1 equal one process).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

# What torch.autograd.grad calls, private but unchanged across torch 2.x: W makes one call per
# parameter group, and autograd.grad's argument handling around it cost ~50 us a call here
# (stage 1 of notebook 08's GPT, 20 groups: W 3.20 ms this way, 4.27 through autograd.grad,
# taking turns in one process, 2026-11-27 06:26 UTC, load 1.1). tests/pipeline checks the result.
_engine = torch.autograd.Variable._execution_engine


def _node(t: torch.Tensor) -> Node | None:
    """t's grad_fn, or for a leaf its AccumulateGrad node (made through a view if not yet made)."""
    if t.grad_fn is not None or not t.requires_grad:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


@dataclass
class _Group:
    params: list[torch.Tensor]
    nodes: list[Node]                                   # its intermediates
    grads: list[tuple | None] = field(default_factory=list)  # what B saw arrive at each


@dataclass
class Kept:
    """What W needs after B: the parameter groups (their intermediates keep the graph below them)."""
    groups: list[_Group]


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """Every node reachable from `root` -> the nodes whose next_functions name it (reverse edges)."""
    users: dict[Node, list[Node]] = defaultdict(list)
    seen, queue = {root}, deque([root])
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is not None:
                users[nxt].append(node)
                if nxt not in seen:
                    seen.add(nxt)
                    queue.append(nxt)
    return users


def _above(start: Node, users: dict[Node, list[Node]], stop: set[Node] = frozenset()) -> tuple[set, list]:
    """Walk reverse edges from `start`, not past a node of `stop`: (the nodes walked, the nodes of
    `stop` met, in the order met)."""
    seen, queue, met = {start}, deque([start]), []
    while queue:
        for user in users.get(queue.popleft(), ()):
            if user not in seen:
                seen.add(user)
                (met if user in stop else queue).append(user)
    return seen, met


# --8<-- [start:split]
def backward_input(out: torch.Tensor, grad_out: torch.Tensor | None, x: torch.Tensor,
                   params: list[torch.Tensor]) -> tuple[torch.Tensor, Kept]:
    """B: x's gradient (of `out`, weighted by `grad_out`), and what `backward_weight` needs."""
    users = _consumers(out.grad_fn)
    on_input_walk, _ = _above(_node(x), users)  # the nodes B runs: those on a path from out to x
    groups: list[_Group] = []  # in parameter order; a parameter joins the groups it shares a node with
    for p in params:
        acc = _node(p)
        if acc not in users:
            continue  # unused on this stage: no gradient
        met = _above(acc, users, on_input_walk)[1]  # not empty: every path up reaches out, on B's walk
        shared = [g for g in groups if any(n in g.nodes for n in met)]
        group = shared[0] if shared else _Group([], [])
        for other in shared[1:]:
            group.params += other.params
            group.nodes += other.nodes
            groups.remove(other)
        group.params.append(p)
        group.nodes += [n for n in met if n not in group.nodes]
        if not shared:
            groups.append(group)
    seen: dict[Node, tuple] = {}
    hooks = [n.register_prehook(lambda grads, n=n: seen.__setitem__(n, grads)) for g in groups for n in g.nodes]
    try:
        (grad_x,) = torch.autograd.grad(out, x, grad_out, retain_graph=True)
    finally:
        for h in hooks:
            h.remove()
    for g in groups:
        g.grads = [seen.get(n) for n in g.nodes]
    return grad_x, Kept(groups)


def backward_weight(kept: Kept) -> None:
    """W: each group's parameter gradients from its intermediates' recorded gradients, into .grad,
    then each parameter's post-accumulate-grad hooks, all inside one backward (`in_one_backward`)."""
    hooked = {id(p) for g in kept.groups for p in g.params if post_accumulate_grad_hooks(p)}
    if hooked:  # (that backward costs ~40 us a W: not paid where no parameter has a hook)
        in_one_backward(lambda: _weight_groups(kept, hooked))
    else:
        _weight_groups(kept, hooked)


def _weight_groups(kept: Kept, hooked: set[int]) -> None:
    # Last group first, as a plain backward reaches the parameters (DDP's buckets fill in launch order).
    for g in reversed(kept.groups):
        fed = [(n, ds) for n, ds in zip(g.nodes, g.grads) if ds is not None]
        edges = [(GradientEdge(n, k), d) for n, ds in fed for k, d in enumerate(ds) if d is not None]
        if not edges:
            continue
        # a node that another of the group's intermediates feeds in W takes what B saw, not that plus its seed
        clamp = [n.register_prehook(lambda _, ds=ds: ds) for n, ds in fed] if len(g.nodes) > 1 else []
        try:  # autograd.grad(edges, params, grads, retain_graph=True, allow_unused=True), unwrapped
            grads = _engine.run_backward(tuple(e for e, _ in edges), tuple(d for _, d in edges), True, False,
                                         tuple(g.params), True, False)
        finally:
            for h in clamp:
                h.remove()
        accumulate(g.params, grads, [d for _, d in edges])
        for p, d in zip(reversed(g.params), reversed(grads)) if hooked else ():
            if d is not None and id(p) in hooked:  # as AccumulateGrad: once per backward that reached p, after .grad
                for hook in post_accumulate_grad_hooks(p):
                    if (returned := hook(p)) is not None:
                        raise TypeError(f"a post-accumulate-grad hook must return None, got {type(returned)}")


# --8<-- [end:split]


def post_accumulate_grad_hooks(p: torch.Tensor) -> list:
    """p's `register_post_accumulate_grad_hook` hooks, in registration order. Private: torch keeps
    them in `Tensor._post_accumulate_grad_hooks` (an OrderedDict, None before the first) and runs
    them only from p's AccumulateGrad node. W cannot go through that node: the engine applies
    p's tensor hooks (`register_hook`) to a gradient on its way into the node, also where W's
    `run_backward` captures it, so feeding the node the captured gradient would apply them twice.
    `test_pp_zb_hooks_torch_keeps_post_accumulate_hooks_where_w_reads_them` fails if torch moves them."""
    hooks = getattr(p, "_post_accumulate_grad_hooks", None)
    return list(hooks.values()) if hooks else []


class _OneBackward(torch.autograd.Function):
    """A node whose backward runs `work`: what a hook queues there with `queue_callback` (DDP's and
    ZeRO's end of backward) joins this node's graph task and runs once, after all of `work`."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, work) -> torch.Tensor:
        ctx.work = work
        return anchor.clone()

    @staticmethod
    def backward(ctx, _):
        ctx.work()
        return None, None


_ANCHOR = torch.zeros((), requires_grad=True)  # a leaf to start `_OneBackward` from; never gets a gradient


def in_one_backward(work) -> None:
    """Run `work` (which may run the autograd engine itself, re-entrantly) as one backward: the
    engine's end-of-backward callbacks queued during it run once, when it is done, as after a
    plain `loss.backward()`. W makes one engine call per parameter group; without this, DDP's
    end of backward would run after the first group's, before the others' gradients exist."""
    with torch.enable_grad():  # (W may be called under no_grad: autograd.grad works there, so W must)
        out = _OneBackward.apply(_ANCHOR, work)
    _engine.run_backward((out,), (torch.ones_like(out),), False, False, (), True, True)


def accumulate(params, grads, fed=()) -> None:
    """p.grad += each gradient, in place as autograd's AccumulateGrad does (`p.grad + d` allocates a
    new gradient per parameter per micro-batch: 0.6 of W's 2.8 ms on stage 1 of notebook 08's GPT).
    Where .grad is None it takes the gradient itself, or a copy if its storage is also one of `fed`
    (the gradients this backward was seeded with, which autograd may pass through unchanged) or an
    earlier parameter's: a later in-place add must not change another tensor. A None gradient (an
    unused parameter) leaves p alone. A gradient not laid out as p (a `p.sum()`'s arrives expanded,
    stride 0, where an in-place add raises) is copied into p's layout, as AccumulateGrad does."""
    taken = {t.untyped_storage().data_ptr() for t in fed}
    for p, d in zip(params, grads):
        if d is None:
            continue
        if p.grad is not None:
            p.grad.add_(d)
            continue
        ptr = d.untyped_storage().data_ptr()
        p.grad = torch.empty_like(p).copy_(d) if ptr in taken or d.stride() != p.stride() else d
        taken.add(ptr)
