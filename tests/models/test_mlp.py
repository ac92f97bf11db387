"""TinyMLP: the harness model with a parameter used twice, a frozen layer and a tied weight."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.func import functional_call

from tinyscale.models import TinyMLP


def data(rows: int = 6, dim: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, dim, generator=gen, dtype=torch.float64), torch.randn(rows, dim, generator=gen,
                                                                                  dtype=torch.float64)


def test_models_mlp_has_frozen_tied_and_shared_parameters():
    model = TinyMLP()
    names = [name for name, _ in model.named_parameters()]
    # A module's own parameters come before its children's (the init draws in this order).
    assert names == ["out_bias", "fc_in.weight", "fc_in.bias", "shared.weight", "shared.bias",
                     "frozen.weight", "frozen.bias"]
    assert not model.frozen.weight.requires_grad and not model.frozen.bias.requires_grad
    assert model.fc_in.weight.dtype == torch.float64


def test_models_mlp_frozen_gets_no_grad_and_every_trainable_param_does():
    model = TinyMLP()
    model(*data()).backward()
    for name, p in model.named_parameters():
        if name.startswith("frozen."):
            assert p.grad is None, name
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("name", ["shared.weight", "fc_in.weight", "shared.bias"])
def test_models_mlp_gradients_of_reused_params_match_finite_differences(name):
    # gradcheck compares autograd with central differences in float64: a missing contribution
    # from the second use of `shared` (or from the tied output projection) would fail it.
    model = TinyMLP(dim=3, hidden=4, seed=1)
    x, y = data(rows=5, dim=3)

    def loss_of(value: torch.Tensor) -> torch.Tensor:
        return functional_call(model, {name: value}, (x, y))

    value = dict(model.named_parameters())[name].detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(loss_of, (value,), eps=1e-6, atol=1e-8)


def test_models_mlp_shared_grad_is_the_sum_of_both_uses():
    model = TinyMLP(seed=2)
    x, y = data(seed=3)
    model(x, y).backward()
    # The same forward by hand, with the two uses of `shared` given separate copies of its weight.
    w1, w2 = (model.shared.weight.detach().clone().requires_grad_(True) for _ in range(2))
    b = model.shared.bias.detach()
    h = torch.tanh(model.fc_in(x))
    h = torch.tanh(h @ w1.T + b)
    h = torch.tanh(model.frozen(h))
    h = torch.tanh(h @ w2.T + b)
    out = h @ model.fc_in.weight.detach() + model.out_bias.detach()
    torch.mean((out - y) ** 2).backward()
    torch.testing.assert_close(model.shared.weight.grad, w1.grad + w2.grad, rtol=1e-12, atol=1e-15)
    assert not torch.allclose(w1.grad, w2.grad)  # two genuinely different contributions


def test_models_mlp_init_is_deterministic_and_ignores_global_rng():
    torch.manual_seed(0)
    a = TinyMLP(seed=5)
    torch.manual_seed(99)
    b, c = TinyMLP(seed=5), TinyMLP(seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name
    torch.testing.assert_close(TinyMLP(seed=5, dtype=torch.float32).fc_in.weight.double(), a.fc_in.weight,
                               rtol=0, atol=0)


@given(rows=st.integers(1, 9), seed=st.integers(0, 1000))
def test_models_mlp_loss_is_mean_over_rows_of_row_means(rows, seed):
    model = TinyMLP()
    x, y = data(rows=rows, seed=seed)
    per_row = torch.stack([model(x[i:i + 1], y[i:i + 1]) for i in range(rows)])
    torch.testing.assert_close(model(x, y), per_row.mean(), rtol=1e-13, atol=1e-15)


def test_models_mlp_invalid_sizes_raise():
    with pytest.raises(ValueError, match="hidden=0"):
        TinyMLP(hidden=0)
