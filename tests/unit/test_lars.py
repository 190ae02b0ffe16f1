"""LARS against updates computed by hand on a toy model, the exclusions, and bad input."""


import pytest
import torch
from torch import nn

from pipesgd.optim import LARS


def toy():
    """A 2-input, 1-output linear layer with w = [3, 4] (||w|| = 5) and b = [1]."""
    layer = nn.Linear(2, 1)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[3.0, 4.0]]))
        layer.bias.copy_(torch.tensor([1.0]))
    return layer


def set_grads(layer, gw, gb):
    layer.weight.grad = torch.tensor([gw])
    layer.bias.grad = torch.tensor(gb)


def test_two_steps_by_hand():
    layer = toy()
    opt = LARS(layer.parameters(), lr=2.0, momentum=0.9, weight_decay=0.1, trust_coefficient=0.01)
    # Step 1. weight: g = [0.6, 0.8], ||g|| = 1; local = 0.01·5 / (1 + 0.1·5) = 1/30;
    # d = g + 0.1·w = [0.9, 1.2]; v = 2·(1/30)·d = [0.06, 0.08]; w = [2.94, 3.92].
    # bias (excluded: no trust ratio, no decay): v = 2·0.5 = 1.0; b = 0.0.
    set_grads(layer, [0.6, 0.8], [0.5])
    opt.step()
    assert torch.allclose(layer.weight, torch.tensor([[2.94, 3.92]]), atol=1e-6)
    assert torch.allclose(layer.bias, torch.tensor([0.0]), atol=1e-7)
    # Step 2. weight: ||w|| = sqrt(2.94² + 3.92²) = 4.9; g = [0, 2], ||g|| = 2;
    # local = 0.01·4.9 / (2 + 0.49) = 0.049 / 2.49; d = [0.294, 2.392];
    # v = 0.9·[0.06, 0.08] + 2·local·d; bias: v = 0.9·1.0 + 2·(-1.0) = -1.1; b = 1.1.
    set_grads(layer, [0.0, 2.0], [-1.0])
    opt.step()
    local = 0.049 / 2.49
    v = [0.9 * 0.06 + 2 * local * 0.294, 0.9 * 0.08 + 2 * local * 2.392]
    assert torch.allclose(layer.weight, torch.tensor([[2.94 - v[0], 3.92 - v[1]]]), atol=1e-6)
    assert torch.allclose(layer.bias, torch.tensor([1.1]), atol=1e-6)


def test_update_is_relative_to_the_weights_whatever_the_gradient_scale():
    """The point of LARS: without momentum and decay, ||Δw|| = lr·η·||w|| for any ||g||."""
    for scale in (1e-4, 1.0, 1e4):
        layer = toy()
        opt = LARS(layer.parameters(), lr=1.0, momentum=0.0, trust_coefficient=0.02)
        set_grads(layer, [scale, -scale], [0.0])
        before = layer.weight.detach().clone()
        opt.step()
        assert (layer.weight - before).norm().item() == pytest.approx(0.02 * 5, rel=1e-5)


def test_bn_parameters_are_excluded_and_zero_norms_fall_back_to_plain_sgd():
    bn = nn.BatchNorm1d(2)
    conv = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        conv.weight.zero_()
    opt = LARS(list(bn.parameters()) + list(conv.parameters()), lr=0.5, momentum=0.0,
               weight_decay=0.1, trust_coefficient=0.001)
    for p in list(bn.parameters()) + list(conv.parameters()):
        p.grad = torch.ones_like(p)
    opt.step()
    assert torch.allclose(bn.weight, torch.full((2,), 0.5))  # 1 - 0.5·1: no decay, no trust ratio
    assert torch.allclose(bn.bias, torch.full((2,), -0.5))
    assert torch.allclose(conv.weight, torch.full((2, 2), -0.5))  # ||w|| = 0: trust ratio 1


def test_exclude_1d_false_adapts_biases_too():
    layer = toy()
    opt = LARS(layer.parameters(), lr=1.0, momentum=0.0, trust_coefficient=0.1, exclude_1d=False)
    set_grads(layer, [0.0, 0.0], [4.0])
    opt.step()
    assert layer.bias.item() == pytest.approx(1.0 - 0.1 * 1.0 / 4.0 * 4.0)  # lr·η·||b||/||g||·g


@pytest.mark.parametrize("value", [0, -0.5, float("nan")])
def test_non_positive_trust_coefficient_names_the_key(value):
    with pytest.raises(ValueError, match=r"optimizer.trust_coefficient=.* is invalid: must be a number > 0"):
        LARS(toy().parameters(), trust_coefficient=value)
