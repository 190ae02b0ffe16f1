"""The library entry (``from pipesgd import PipeSGD``) refuses what would go silently wrong in a
ported DDP script."""

import pytest
import torch
from torch import nn

from pipesgd import PipeSGD


def _engine():
    model = nn.Linear(4, 2)
    return PipeSGD(torch.optim.SGD(model.parameters(), lr=0.1), model.parameters(), width=2)


def test_world_size_without_a_process_group_is_an_error(monkeypatch):
    """torchrun sets WORLD_SIZE; forgetting init_process_group must not train p lone replicas."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 in the environment .* no torch.distributed process "
                                           r"group: call torch.distributed.init_process_group"):
        _engine()


@pytest.mark.parametrize("world", [None, "1"])
def test_a_lone_process_needs_no_process_group(monkeypatch, world):
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    engine = _engine()
    assert engine.in_flight == 0
    engine.close()
