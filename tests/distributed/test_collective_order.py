"""engine.collective(): the caller's collectives run on the engine's communication thread, after the
reductions already queued, so every rank drives its groups in one order (NCCL's requirement; the
trainer's evaluation and replica check go through it). 2 Gloo ranks."""

import contextlib
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
    _, in_flight = next(iter(engine.schedule))
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


_COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "batch_isend_irecv", "isend", "irecv", "send", "recv",
                "gather_object", "all_gather_object", "barrier")


def _ported_loop_worker(rank, p, join: bool):
    """A DDP user's loop ported as the guide says: ``module=`` with BatchNorm buffers, and a metric
    all-reduce after an "epoch" with an update still in flight, through engine.collective. Every
    collective a rank issues once the engine exists is noted with the thread that issued it."""
    torch.manual_seed(rank)  # the engine takes rank 0's weights and buffers
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PipeSGD(opt, model.parameters(), width=2, module=model, timeout_s=60)
    issued = []
    for name in _COLLECTIVES:
        real = getattr(dist, name)

        def noted(*args, _real=real, _name=name, **kwargs):
            issued.append((_name, threading.current_thread().name))
            return _real(*args, **kwargs)

        setattr(dist, name, noted)
    steps = 3 if rank == 0 and join else 4
    with engine.join() if join else contextlib.nullcontext():
        for step in range(steps):
            opt.zero_grad()
            model(torch.randn(5, 6) + rank).square().mean().backward()  # per-rank data: buffers diverge
            engine.step()
            if step == 1:
                correct = torch.tensor([float(rank + 1)])  # a test() metric, averaged over ranks
                engine.collective(lambda: dist.all_reduce(correct), "metric all-reduce")
    engine.flush()
    bn = model[1]
    buffers = torch.cat([bn.running_mean, bn.running_var, bn.num_batches_tracked.reshape(1).float()])
    engine.close()
    return issued, correct.item(), buffers


@pytest.mark.timeout(240)
@pytest.mark.parametrize("join", [False, True], ids=["even", "uneven-join"])
def test_a_ported_loop_issues_every_collective_on_the_engine_thread(join):
    """On NCCL the engine's reductions run on its communication thread; a collective issued from
    the training thread meanwhile (broadcast_buffers used to be, on a group of its own) can
    deadlock. Every collective a ported loop causes, the buffers' broadcast and the user's metric
    all-reduce included, is issued on the communication thread, in one order on every rank."""
    (issued0, metric0, buffers0), (issued1, metric1, buffers1) = run_workers(_ported_loop_worker, 2, join,
                                                                                timeout=200)
    for issued in (issued0, issued1):
        assert issued and {thread for _, thread in issued} == {"pipesgd-comm"}, issued
        assert ("broadcast", "pipesgd-comm") in issued
    assert [name for name, _ in issued0] == [name for name, _ in issued1]  # one order on every rank
    assert metric0 == metric1 == 3.0
    # each step() ends with rank 0's buffers everywhere (its data differ per rank: without the
    # broadcast the running statistics would too); a joined rank 0 still sends them
    assert torch.equal(buffers0, buffers1)
