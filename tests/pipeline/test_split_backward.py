"""Zero-bubble's B/W split (`tinyscale.pipeline.split_backward`) on one process, float64: B's input
gradient and W's parameter gradients equal a plain backward's, on a GPT's later stage and on a
module with a weight used twice on one path, a weight two nodes share, a frozen and an unused
parameter, over two micro-batches (B, B, then W, W as zb_h1 orders them); and no matmul runs in
both B and W (FLOPs). Run: `pytest tests/pipeline -k split_backward`."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from tinyscale.models import GPT, GPTConfig
from tinyscale.pipeline.executor import GPTStage, gpt_loss
from tinyscale.pipeline.partition import partition_gpt
from tinyscale.pipeline.split_backward import backward_input, backward_weight
from tinyscale.testing import assert_state_dicts_close

RTOL = 1e-10  # float64 (eps 2.2e-16): only the order of a few sums differs from the plain backward


class Toy(nn.Module):
    """A weight at the bottom and the top of one path (its two intermediates chained), a scale two
    nodes share, a frozen weight and an unused one."""

    def __init__(self, c: int = 6) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        new = lambda *s: nn.Parameter(torch.randn(*s, generator=g, dtype=torch.float64) / c ** 0.5)  # noqa: E731
        self.w, self.scale, self.unused = new(c, c), new(c), new(c)
        self.frozen = new(c, c).requires_grad_(False)
        self.a = nn.Linear(c, c, dtype=torch.float64)
        self.b = nn.Linear(c, c, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w) @ self.frozen  # (N, c)
        h = self.a(h) * self.scale + torch.sin(self.b(h) * self.scale)
        return torch.tanh(h @ self.w.t())


def _later_gpt_stage(tied: bool, attn_impl: str = "sdpa") -> GPTStage:
    cfg = GPTConfig(vocab_size=64, max_seq_len=8, n_layer=3, n_head=4, n_kv_head=2, d_model=16, ffn_hidden=24,
                    tie_embeddings=tied, attn_impl=attn_impl)
    return GPTStage(GPT(cfg, seed=3, dtype=torch.float64), partition_gpt(cfg, 2)[1])  # blocks, norm, head


def _run(module, inputs, targets, loss, split: bool):
    """Two micro-batches: plain backward of each, or B of both then W of both. -> (input grads, .grads)."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in module.parameters():
        p.grad = None
    grads_in, kept = [], []
    for x, y in zip(inputs, targets):
        x = x.clone().requires_grad_()
        out = loss(module(x), y)
        if split:
            g, k = backward_input(out, None, x, params)
            grads_in.append(g)
            kept.append(k)
        else:
            out.backward()
            grads_in.append(x.grad)
    for k in kept:
        backward_weight(k)
    return grads_in, {n: p.grad for n, p in module.named_parameters() if p.grad is not None}


def _check(module, inputs, targets, loss, what):
    plain_in, plain = _run(module, inputs, targets, loss, split=False)
    split_in, split = _run(module, inputs, targets, loss, split=True)
    assert_state_dicts_close(dict(enumerate(split_in)), dict(enumerate(plain_in)), rtol=RTOL, what=f"{what}: B")
    assert_state_dicts_close(split, plain, rtol=RTOL, what=f"{what}: W")
    return split


def test_pp_split_backward_tied_shared_frozen_unused_equal_plain_backward_float64():
    toy = Toy()
    g = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(2, 5, 6, generator=g, dtype=torch.float64), torch.randn(2, 5, 6, generator=g)
    grads = _check(toy, inputs, targets, lambda out, y: ((out - y) ** 2).sum(), "toy")
    assert set(grads) == {"w", "scale", "a.weight", "a.bias", "b.weight", "b.bias"}  # not frozen, not unused


class PassThrough(nn.Module):
    """Two biases added as they are: autograd hands each the gradient it received, one tensor for
    both and for the input (no copy), so W's first gradient of a is b's and B's input gradient."""

    def __init__(self, c: int = 6) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(c, dtype=torch.float64))
        self.b = nn.Parameter(torch.ones(c, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.a + self.b


def test_pp_split_backward_accumulates_in_place_without_changing_an_aliased_gradient():
    """W adds in place from the second micro-batch on (as AccumulateGrad does); where autograd passes
    one tensor to two parameters and the input, .grad takes a copy, so the later add changes
    neither the other parameter's gradient nor B's input gradient (equal a plain backward's)."""
    g = torch.Generator().manual_seed(4)
    inputs, weights = torch.randn(2, 6, generator=g, dtype=torch.float64), torch.randn(2, 6, generator=g)
    _check(PassThrough(), inputs, weights, lambda out, w: (out * w).sum(), "pass-through")


def test_pp_split_backward_gpt_later_stage_equal_plain_backward_float64():
    for tied in (False, True):  # tied: the head's weight is the embedding's (stage 0's)
        stage = _later_gpt_stage(tied)
        g = torch.Generator().manual_seed(2)
        inputs = torch.randn(2, 2, 8, 16, generator=g, dtype=torch.float64)  # 2 micro-batches of (B, T, C)
        targets = torch.randint(0, 64, (2, 2, 8), generator=g)
        _check(stage, inputs, targets, gpt_loss, f"GPT stage 1, tied={tied}")


def test_pp_split_backward_w_runs_only_the_weight_matmuls():
    """On a dense stage every matmul's backward is two matmuls of the forward's size, one for the
    input and one for the weight: B computes the first kind, W the second, none twice (B + W = the
    full backward's FLOPs, where W walking the graph again cost a full backward), and W is under half
    of it (the attention's score and value products, explicit matmuls here, have no weight)."""
    stage = _later_gpt_stage(False, attn_impl="math")
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    y = torch.randint(0, 64, (2, 8))
    params = [p for p in stage.parameters() if p.requires_grad]

    def flops(fn) -> int:
        with FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()

    def forward():
        xi = x.clone().requires_grad_()
        return xi, gpt_loss(stage(xi), y)

    xi, out = forward()
    full = flops(lambda: torch.autograd.backward(out))
    xi, out = forward()
    kept = []
    b = flops(lambda: kept.append(backward_input(out, None, xi, params)[1]))
    w = flops(lambda: backward_weight(kept[0]))
    assert b + w == full, (b, w, full)
    assert 0.3 * full < w < 0.5 * full, (b, w, full)


def test_pp_split_backward_keeps_the_graph_below_the_weights_and_their_gradients_until_w():
    """Between B and W: on a middle stage (no head) every saved tensor stays (the intermediates'
    next_functions hold the graph below them), on the last stage all but the loss's and the
    head's; the gradients B saw arrive at the weights' nodes are kept beside them (18,432 B here
    against the stage's 2,048 B output gradient). Once W is done, nothing stays. Bytes of the saved
    tensors still alive, the input's and the parameters' left out."""
    import gc
    import weakref

    for last in (False, True):
        stage = _later_gpt_stage(False)
        if not last:
            stage.norm = stage.head = None
        params = [p for p in stage.parameters() if p.requires_grad]
        x = torch.randn(2, 8, 16, dtype=torch.float64, requires_grad=True)
        skip = {q.untyped_storage().data_ptr() for q in (x, *params)}
        refs = []

        def pack(t):  # a detached alias: a saved output itself would hold its own node (a cycle)
            if t.untyped_storage().data_ptr() in skip:
                return t
            alias = t.detach()
            refs.append((weakref.ref(alias), t.untyped_storage().nbytes()))
            return alias

        def alive() -> int:
            gc.collect()
            return sum(n for ref, n in refs if ref() is not None)

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = stage(x)
            grad_out = torch.randn_like(out)
            if last:
                out, grad_out = gpt_loss(out, torch.randint(0, 64, (2, 8))), None
        after_forward = alive()
        kept = backward_input(out, grad_out, x, params)[1]
        del out
        between = alive()
        arriving = {d.untyped_storage().data_ptr(): d.untyped_storage().nbytes()
                    for g in kept.groups for ds in g.grads for d in ds if d is not None}
        assert (between < after_forward) if last else (between == after_forward), (last, between, after_forward)
        if not last:
            assert sum(arriving.values()) == 18_432 and x.numel() * 8 == 2_048
        backward_weight(kept)
        del kept
        assert alive() == 0
