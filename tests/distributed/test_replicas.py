"""Replicas start identical under the library API whatever each process seeded, as under DDP: the
engine takes the first rank's parameters, and its buffers when given the module."""

import pytest
import torch
from torch import nn

from distributed_utils import run_workers
from pipesgd import PipeSGD


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model(torch.randn(16, 6))  # running statistics that differ per seed
    return model


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().double().reshape(-1) for t in tensors])


def _worker(rank, p, with_module):
    model = _model(seed=rank)
    before = _flat(model.parameters())
    PipeSGD(torch.optim.SGD(model.parameters(), lr=0.1), model.parameters(),
            module=model if with_module else None).close()
    return before, _flat(model.parameters()), _flat(model.buffers())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("with_module", [True, False])
def test_every_rank_starts_from_the_first_ranks_weights(with_module):
    (before0, params0, buffers0), *others = run_workers(_worker, 3, with_module)
    assert torch.equal(before0, params0), "rank 0 keeps its own"
    for before, params, buffers in others:
        assert not torch.equal(before, before0), "the ranks really seeded differently"
        assert torch.equal(params, params0)
        assert torch.equal(buffers, buffers0) == with_module, "buffers follow only when the module is given"
