"""engine.collective(): the caller's collectives run on the engine's communication thread, after the
reductions already queued, so every rank drives its groups in one order (NCCL's requirement; the
trainer's evaluation and replica check go through it). 2 Gloo ranks."""

import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed_utils import run_workers
from pipesgd import PipeSGD
from pipesgd.comm import CommError


def _worker(rank, p):
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PipeSGD(opt, model.parameters(), width=2, timeout_s=30)
    model(torch.randn(8, 64)).square().mean().backward()
    engine.step()  # one reduction in flight
    in_flight = engine._pending[0]
    seen = {}

    def evaluation():
        seen["thread"] = threading.current_thread().name
        seen["after_reduction"] = in_flight.done()
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)  # the default group, from the engine's thread
        return total.item()

    total = engine.collective(evaluation, "summing evaluation counts")

    def broken():
        raise RuntimeError("Connection closed by peer")

    try:
        engine.collective(broken, "summing evaluation counts")
    except CommError as e:
        error = str(e)
    engine.flush()
    engine.close()
    return seen, total, error


@pytest.mark.timeout(120)
def test_collectives_run_on_the_engine_thread_after_the_reductions_in_flight():
    for seen, total, error in run_workers(_worker, 2):
        assert seen == {"thread": seen["thread"], "after_reduction": True}
        assert seen["thread"].startswith("pipesgd-comm")
        assert total == 3.0
        assert error.startswith("summing evaluation counts: RuntimeError: Connection closed by peer")
