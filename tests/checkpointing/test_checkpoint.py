"""checkpoint(fn, ...) itself: gradients bit-identical to no checkpointing, with dropout on.

One suite for our two variants and torch.utils.checkpoint's two, reached through the seam
(`CHECKPOINTS`; a learner's file joins with TINYSCALE_IMPL_ACTIVATION_CHECKPOINT=file.py:fn,
where fn(fn, *args, **kwargs) returns fn's output). Techniques that must not change the math
are held to torch.equal, not a tolerance: recomputation runs the same kernels on the same
inputs with the same dropout masks, so any difference at all is a bug.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from tinyscale.checkpointing import checkpoint, checkpoint_nonreentrant, checkpoint_reentrant, saved_bytes
from tinyscale.models import GPT, GPTConfig
from tinyscale.testing import implementations, resolve

CHECKPOINTS = implementations("activation_checkpoint", {
    "nonreentrant": "tinyscale.checkpointing:checkpoint_nonreentrant",
    "nonreentrant_no_early_stop": "tests.checkpointing.torch_impls:nonreentrant_without_early_stop",
    "reentrant": "tinyscale.checkpointing:checkpoint_reentrant",
    "torch_nonreentrant": "tests.checkpointing.torch_impls:torch_nonreentrant",
    "torch_reentrant": "tests.checkpointing.torch_impls:torch_reentrant",
})
DTYPES = [torch.float32, torch.float64]


def run(fn, *args, seed: int, impl=None, **kwargs):
    """fn(*args, **kwargs) (through impl if given) under a fixed seed, then backward of a
    fixed function of every tensor output. Returns (outputs, grads of the leaves that require
    grad, where the global RNG ended): all three must match without checkpointing."""
    torch.manual_seed(seed)
    out = resolve(impl)(fn, *args, **kwargs) if impl else fn(*args, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    tensors = [o for o in outs if torch.is_tensor(o)]
    sum((o * (i + 1)).sum() for i, o in enumerate(tensors)).backward()
    leaves = [a for a in (*args, *kwargs.values(), *_params(fn)) if torch.is_tensor(a) and a.requires_grad]
    grads = [a.grad.clone() if a.grad is not None else None for a in leaves]
    for a in leaves:
        a.grad = None
    return outs, grads, torch.get_rng_state()


def _params(fn):
    owner = getattr(fn, "__self__", fn)
    return list(owner.parameters()) if isinstance(owner, torch.nn.Module) else []


def assert_identical(got, want):
    (outs, grads, rng), (ref_outs, ref_grads, ref_rng) = got, want
    for o, r in zip(outs, ref_outs, strict=True):
        assert torch.equal(o, r) if torch.is_tensor(r) else o == r
    assert len(grads) == len(ref_grads)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert (g is None) == (r is None), f"gradient {i}: one is None"
        assert g is None or torch.equal(g, r), f"gradient {i} differs by {(g - r).abs().max().item():.3g}"
    assert torch.equal(rng, ref_rng), "the recomputation moved the global RNG"


def gpt_block(dtype, seq, impl="math", dropout=0.2, n_kv_head=2):
    cfg = GPTConfig.preset("tiny").with_(dropout=dropout, attn_impl=impl, n_kv_head=n_kv_head)
    model = GPT(cfg, seed=3, dtype=dtype).train()
    return model.blocks[0], model.rope_cos[:seq], model.rope_sin[:seq]


# --------------------------------------------------------------------- bit-identical gradients


@pytest.mark.parametrize("impl", CHECKPOINTS)
@given(batch=st.integers(1, 3), seq=st.integers(1, 12), seed=st.integers(0, 2**16),
       attn=st.sampled_from(["math", "sdpa"]), dtype=st.sampled_from(DTYPES), n_kv_head=st.sampled_from([1, 2, 4]))
def test_activation_checkpoint_gpt_block_grads_bit_identical_with_dropout(impl, batch, seq, seed, attn, dtype, n_kv_head):
    block, cos, sin = gpt_block(dtype, seq, attn, n_kv_head=n_kv_head)
    x = torch.randn(batch, seq, 32, dtype=dtype, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    want = run(block, x, cos, sin, seed=seed)
    assert_identical(run(block, x, cos, sin, seed=seed, impl=impl), want)


def dropout_mlp(x, w1, w2, scale: float, *, p: float):
    """Dropout inside, a non-tensor positional argument and a keyword one."""
    return (F.dropout(torch.tanh(x @ w1), p=p, training=True) @ w2) * scale


# torch's re-entrant checkpoint takes no keyword arguments: it is not a case of this property
WITH_KWARGS = [c for c in CHECKPOINTS if not c.values[0].endswith("torch_reentrant")]


@pytest.mark.parametrize("impl", WITH_KWARGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_checkpoint_non_tensor_and_keyword_arguments(impl, dtype):
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(*s, dtype=dtype, generator=g, requires_grad=True) for s in [(5, 4), (4, 8), (8, 3)])
    want = run(dropout_mlp, x, w1, w2, 0.5, p=0.3, seed=7)
    assert_identical(run(dropout_mlp, x, w1, w2, 0.5, p=0.3, seed=7, impl=impl), want)


def two_outputs(x, w, tag: str):
    h = F.dropout(x @ w, p=0.5, training=True)
    return h.sin(), tag, h.cos()  # a non-tensor between the tensors


@pytest.mark.parametrize("impl", CHECKPOINTS)
def test_activation_checkpoint_multiple_outputs(impl):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 6, generator=g, requires_grad=True), torch.randn(6, 6, generator=g, requires_grad=True)
    want = run(two_outputs, x, w, "tag", seed=11)
    got = run(two_outputs, x, w, "tag", seed=11, impl=impl)
    assert got[0][1] == "tag"
    assert_identical(got, want)


@pytest.mark.parametrize("impl", CHECKPOINTS)
def test_activation_checkpoint_inputs_that_need_no_grad(impl):
    """x needs no gradient, w does: only w gets one, and it is the same."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 6, generator=g), torch.randn(6, 6, generator=g, requires_grad=True)
    fn = lambda x, w: F.dropout(x @ w, p=0.5, training=True).exp()  # noqa: E731
    assert_identical(run(fn, x, w, seed=5, impl=impl), run(fn, x, w, seed=5))


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("attn", ["math", "sdpa"])
def test_activation_checkpoint_agrees_with_torch_utils_checkpoint(use_reentrant, attn):
    """Ours and torch's, same use_reentrant: same outputs, gradients and RNG, bit for bit."""
    block, cos, sin = gpt_block(torch.float32, 9, attn)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(4), requires_grad=True)
    ours = "tinyscale.checkpointing:" + ("checkpoint_reentrant" if use_reentrant else "checkpoint_nonreentrant")
    theirs = "tests.checkpointing.torch_impls:" + ("torch_reentrant" if use_reentrant else "torch_nonreentrant")
    assert_identical(run(block, x, cos, sin, seed=8, impl=ours), run(block, x, cos, sin, seed=8, impl=theirs))


# ------------------------------------------------------------------------- the RNG pitfall


@pytest.mark.parametrize("variant", [checkpoint_nonreentrant, checkpoint_reentrant])
def test_activation_checkpoint_without_rng_state_gets_other_dropout_masks(variant):
    """The source documents' CheckpointFunction (DS-22) does not restore the RNG: the
    recomputation then draws new dropout masks and the gradients are wrong. This is the
    failure preserve_rng_state=True prevents (and shows this suite can see it)."""
    block, cos, sin = gpt_block(torch.float64, 8)
    x = torch.randn(2, 8, 32, dtype=torch.float64, requires_grad=True)
    want = run(block, x, cos, sin, seed=0)
    _, grads, _ = run(lambda *a: variant(block, *a, preserve_rng_state=False), x, cos, sin, seed=0)
    assert not all(torch.equal(g, r) for g, r in zip(grads, want[1]))


def test_activation_checkpoint_dispatch_requires_explicit_use_reentrant():
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(TypeError):
        checkpoint(torch.sin, x)  # keyword-only, no default: the caller picks the variant
    with pytest.raises(ValueError, match="use_reentrant"):
        checkpoint(torch.sin, x, use_reentrant="no")
    assert torch.equal(checkpoint(torch.sin, x, use_reentrant=False), torch.sin(x))


# ------------------------------------------------------------- what only one variant can do


def test_activation_checkpoint_reentrant_loses_parameter_grads_when_no_input_requires_grad():
    """DS-22's second bug: parameters hidden in fn do not make a re-entrant checkpoint's
    output require grad. We warn; the non-re-entrant variant gives the gradients."""
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)  # token-like data: no gradient needed
    with pytest.warns(UserWarning, match="no tensor input requires grad"):
        out = checkpoint_reentrant(lin, x)
    assert not out.requires_grad
    out = checkpoint_nonreentrant(lin, x)
    out.sum().backward()
    assert torch.equal(lin.weight.grad, torch.ones(4, 1) * x.sum(0))


def test_activation_checkpoint_nonreentrant_works_with_autograd_grad_reentrant_refuses():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    (gw,) = torch.autograd.grad(checkpoint_nonreentrant(lambda x: (x @ w).tanh(), x).sum(), [w])
    (want,) = torch.autograd.grad((x @ w).tanh().sum(), [w])
    assert torch.equal(gw, want)
    with pytest.raises(RuntimeError, match="torch.autograd.grad"):  # w is hidden from it: ask for x
        torch.autograd.grad(checkpoint_reentrant(lambda x: (x @ w).tanh(), x).sum(), [x])


def test_activation_checkpoint_nonreentrant_retain_graph_second_backward_recomputes():
    w = torch.randn(4, 4, requires_grad=True, dtype=torch.float64)
    x = torch.randn(3, 4, requires_grad=True, dtype=torch.float64)
    out = checkpoint_nonreentrant(lambda x: F.dropout((x @ w).tanh(), 0.5, training=True), x).sum()
    out.backward(retain_graph=True)
    first = w.grad.clone()
    out.backward()
    assert torch.equal(w.grad, 2 * first)


def test_activation_checkpoint_nonreentrant_catches_inplace_change_of_an_input():
    """Inputs are saved through autograd, so its version counter sees x changed after the
    forward: an error, not a gradient of the wrong input."""
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4)
    out = checkpoint_nonreentrant(lambda x: (x @ w).tanh(), x)
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_activation_checkpoint_nonreentrant_rejects_recompute_that_differs():
    calls = []

    def shape_changing(x):
        calls.append(1)
        return (x[: 2 + len(calls)] ** 2).sum()  # one row more on the rerun

    x = torch.randn(6, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="recomputation saved"):
        checkpoint_nonreentrant(shape_changing, x).backward()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpoint_saves_only_the_inputs(use_reentrant):
    """A checkpointed block keeps its input (p sbh bytes) and nothing else: cos and sin are
    the model's buffers (model state, not counted)."""
    block, cos, sin = gpt_block(torch.float32, 8)
    model_state = torch.nn.ModuleDict({"block": block})
    model_state.register_buffer("cos", cos)
    model_state.register_buffer("sin", sin)
    x = torch.randn(2, 8, 32, requires_grad=True)
    ckpt = lambda *a: checkpoint(block, *a, use_reentrant=use_reentrant)  # noqa: E731
    assert saved_bytes(ckpt, x, cos, sin, exclude_state_of=model_state) == x.numel() * 4


# ------------------------------------------------------------------------------ early stop


def _backward_flops(fn, *args) -> int:
    """Matmul FLOPs of backward through fn(*args) (a fixed function of its tensor outputs), as
    FlopCounterMode counts them: the gradients' own, plus whatever a checkpoint reruns."""
    outs = fn(*args)
    loss = sum((o * (i + 1)).sum() for i, o in enumerate(o for o in (outs if isinstance(outs, tuple) else (outs,))
                                                          if torch.is_tensor(o)))
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_activation_checkpoint_nonreentrant_early_stop_skips_the_unsaved_down_projection(dropout):
    """A block's rerun with early stop runs its forward but the MLP's down projection, whose
    output nothing saves (autograd saves an op's inputs before running it), as torch's does; with
    early_stop=False, and with residual dropout (its mask, drawn after w_down, is saved), all of it."""
    block, cos, sin = gpt_block(torch.float64, 8, dropout=dropout)
    x = torch.randn(2, 8, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with FlopCounterMode(display=False) as fwd:
        block(x, cos, sin)
    plain = _backward_flops(block, x, cos, sin)

    def rerun(impl, **options):
        torch.manual_seed(0)
        return _backward_flops(lambda *a: impl(block, *a, **options), x, cos, sin) - plain

    w_down = 2 * 2 * 8 * block.mlp.w_down.in_features * block.mlp.w_down.out_features  # (B T, F) @ (F, C)
    unsaved = w_down if dropout == 0 else 0
    assert rerun(checkpoint_nonreentrant, early_stop=False) == fwd.get_total_flops()
    assert rerun(checkpoint_nonreentrant) == rerun(checkpoint_nonreentrant, early_stop=True) \
        == fwd.get_total_flops() - unsaved
    assert rerun(checkpoint, use_reentrant=False) == rerun(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    with set_checkpoint_early_stop(False):
        assert rerun(torch.utils.checkpoint.checkpoint, use_reentrant=False) == fwd.get_total_flops()
    assert rerun(checkpoint_reentrant) == fwd.get_total_flops()  # re-entrant: no early stop


def tail_after_the_last_save(x, w, v, u, tag: str):
    """Reads v (an input it does not return); its last op, h @ u, saves h and u before it runs,
    and nothing saves its output: an early-stopped rerun ends before it. A tuple out."""
    h = F.dropout(torch.tanh(x @ w) * v, p=0.5, training=True)
    return h.sin(), tag, h @ u


@pytest.mark.parametrize("impl", WITH_KWARGS)
def test_activation_checkpoint_early_stop_region_reading_a_tensor_it_does_not_return(impl):
    g = torch.Generator().manual_seed(3)
    x, w, v, u = (torch.randn(*s, dtype=torch.float64, generator=g, requires_grad=True)
                  for s in [(5, 4), (4, 6), (6,), (6, 3)])
    want = run(tail_after_the_last_save, x, w, v, u, "t", seed=2)
    assert_identical(run(tail_after_the_last_save, x, w, v, u, "t", seed=2, impl=impl), want)


def test_activation_checkpoint_early_stop_rerun_ends_at_the_last_saved_tensor():
    g = torch.Generator().manual_seed(3)
    x, w, v, u = (torch.randn(*s, dtype=torch.float64, generator=g, requires_grad=True)
                  for s in [(5, 4), (4, 6), (6,), (6, 3)])
    plain = _backward_flops(tail_after_the_last_save, x, w, v, u, "t")
    flops = {stop: _backward_flops(lambda *a: checkpoint_nonreentrant(tail_after_the_last_save, *a, early_stop=stop),
                                   x, w, v, u, "t") - plain for stop in (False, True)}
    assert flops == {False: 2 * 5 * 4 * 6 + 2 * 5 * 6 * 3, True: 2 * 5 * 4 * 6}  # x @ w and h @ u, or x @ w only


@pytest.mark.parametrize("outer_stop, inner_stop", [(True, True), (True, False), (False, True), (False, False)])
def test_activation_checkpoint_nested_regions_grads_bit_identical(outer_stop, inner_stop):
    """The inner region is the outer's last op: the outer's rerun stops (early_stop) when the
    inner checkpoint has saved its inputs, before the inner block runs; the inner region reruns
    from them. Stream dropout on: every mask comes back."""
    block, cos, sin = gpt_block(torch.float64, 6)
    x = torch.randn(2, 6, 32, dtype=torch.float64, requires_grad=True)

    def outer(x):
        return checkpoint_nonreentrant(block, block(x, cos, sin), cos, sin, early_stop=inner_stop)

    assert_identical(run(lambda x: checkpoint_nonreentrant(outer, x, early_stop=outer_stop), x, seed=9),
                     run(lambda x: block(block(x, cos, sin), cos, sin), x, seed=9))


def test_activation_checkpoint_under_no_grad_just_runs():
    w = torch.randn(3, 3, requires_grad=True)
    with torch.no_grad():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "no input requires grad" warning under no_grad
            for variant in (checkpoint_nonreentrant, checkpoint_reentrant):
                out = variant(lambda x: x @ w, torch.ones(2, 3))
                assert not out.requires_grad and torch.equal(out, torch.ones(2, 3) @ w)
