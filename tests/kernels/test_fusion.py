"""OPT-1 on this CPU: fusing bias + GeLU + dropout + residual (tinyscale.kernels.fusion).

Eager runs five ATen ops and writes four intermediates; `torch.compile` (inductor, C++)
runs one kernel that writes only the result, and moves a third of the bytes, with the same
values. What this cannot show is the GPU's side (launch overhead, HBM bandwidth): lesson 11.

    pytest -k fusion_opt1
"""

from __future__ import annotations

import pytest
import torch

from tinyscale.kernels.fusion import bias_gelu_dropout_residual, chain_inputs, compiled_traffic, eager_traffic

ROWS, HIDDEN = 64, 256
E = ROWS * HIDDEN * 4  # bytes of one (rows, hidden) float32 tensor


@pytest.fixture(scope="module")
def traffic():
    args = chain_inputs(ROWS, HIDDEN)
    return args, eager_traffic(bias_gelu_dropout_residual, *args), compiled_traffic(bias_gelu_dropout_residual, *args)


def test_fusion_opt1_eager_launches_an_op_per_step_and_writes_every_intermediate(traffic):
    _, eager, _ = traffic
    assert eager["ops"] == ["add.Tensor", "gelu.default", "mul.Tensor", "mul.Tensor", "add.Tensor"]
    assert eager["intermediates"] == 4 and eager["intermediate_bytes"] == 4 * E
    # read: x + bias, gelu, (., keep), (., scale), (., residual); written: five tensors
    bias = HIDDEN * 4
    assert eager["bytes"] == (E + bias) + E + 2 * E + E + 2 * E + 5 * E


def test_fusion_opt1_compiled_chain_is_one_kernel_that_moves_each_tensor_once(traffic):
    args, eager, fused = traffic
    assert fused["kernels"] == 1 and fused["buffers"] == 1 and fused["intermediates"] == 0, fused["code"]
    assert fused["bytes"] == 4 * E + HIDDEN * 4  # read x, keep, residual, bias; write out
    assert eager["bytes"] > 2.9 * fused["bytes"]  # 3.0 at this shape


def test_fusion_opt1_fused_values_equal_eager(traffic):
    args, eager, fused = traffic
    # float32 values of O(1-10): the fused kernel evaluates gelu's erf and the products in
    # another order (vectorised), a few ulps (~1e-6 at |v| ~ 4); a wrong mask or scale is O(0.1).
    torch.testing.assert_close(fused["out"], eager["out"], rtol=1e-5, atol=1e-5)
    x, bias, keep, residual = args
    dropped = keep == 0
    assert dropped.any() and torch.equal(eager["out"][dropped], residual[dropped])
