"""fp16 on NCCL's own all_reduce (the default path for fp16 on NCCL, comm=auto) sums in 16 bits
(docs/gpu.md, "The third pass", defect 4). Undivided, p gradients near 65504/p overflowed to inf
on every rank alike, with the non-finite flag 0 (set from each rank's own, finite values), so every
replica applied inf. The path divides by p before the cast, and a sum that overflows anyway sets the flag."""

from __future__ import annotations

import pytest
import torch
from fake_dist import FakeDist
from torch import nn

from pipesgd import NonFiniteGradient
from pipesgd.comm import native_allreduce
from pipesgd.engine.pipe import PipeSGD

LR = 1e-5


def one_step(monkeypatch, value: float, nonfinite: str = "abort"):
    """Two fake NCCL ranks that both computed ``value`` everywhere; fp16, comm=auto, width 1."""
    FakeDist(2, 0, "nccl", sums=True).install(monkeypatch)
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with PipeSGD(opt, model.parameters(), width=1, compressor="fp16", nonfinite=nonfinite) as engine:
        assert engine._reducer.allreduce is native_allreduce, "comm=auto on NCCL takes the backend's all_reduce"
        model.weight.grad = torch.full_like(model.weight, value)
        stats = engine.step()
    return model.weight.detach().clone(), stats


def test_a_gradient_above_65504_over_p_is_averaged_not_overflowed(monkeypatch):
    weight, stats = one_step(monkeypatch, 40_000.0)  # 2 x 40000 > 65504; 2 x 20000 is not
    assert stats.applied
    torch.testing.assert_close(weight, torch.full_like(weight, -LR * 40_000.0), rtol=1e-6, atol=0)


@pytest.mark.parametrize("nonfinite", ["skip", "abort"])
def test_a_16_bit_sum_that_overflows_anyway_is_flagged_on_every_rank(monkeypatch, nonfinite):
    """1e5 is finite on each rank (and 5e4 after the division), but the fp16 sum is not."""
    if nonfinite == "abort":
        with pytest.raises(NonFiniteGradient, match="no rank reports NaN/inf of its own: the sum overflowed"):
            one_step(monkeypatch, 1e5, nonfinite)
        return
    weight, stats = one_step(monkeypatch, 1e5, nonfinite)
    assert stats.skipped and not stats.applied
    assert torch.equal(weight, torch.zeros_like(weight)), "the overflowed average must not be applied"


def test_the_nccl_fake_sums_in_the_payloads_own_dtype(monkeypatch):
    """The control: the fake overflows where NCCL's 16-bit sum does, and not in fp32."""
    fake = FakeDist(2, 0, "nccl", sums=True).install(monkeypatch)
    half, full = torch.full((3,), 40_000.0, dtype=torch.float16), torch.full((3,), 40_000.0)
    fake.all_reduce(half)
    fake.all_reduce(full)
    assert torch.isinf(half).all() and torch.equal(full, torch.full((3,), 80_000.0))
