"""A backend whose ``wait()`` returns before the data lands (docs/gpu.md): NCCL's ``Work.wait()``
only makes the current stream wait, and its blocking collectives only enqueue, so code that relies
on the CPU having blocked until the bytes arrived is wrong on a GPU and right with Gloo.

On 2 Gloo ranks the communication thread's calls are replaced by late ones: ``irecv``/``isend``
return a handle whose ``wait()`` returns at once, and ``all_reduce``/``all_gather``/``broadcast``
return before they finish. What a GPU guarantees is kept, nothing more: the data lands before the
next tensor operation of that thread (stream order), and before the job's done-event is waited
for. A host read of a value that has not landed fails. Every engine run then ends bit-identical to
the same run on the blocking backend; a control job that reads a received value on the host after
``wait()`` shows the fake catches that.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from distributed_utils import run_workers

HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
              torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__}
_local = threading.local()


class NotLanded(AssertionError):
    pass


class LateLanding(TorchFunctionMode):
    """The communication thread's stream: work the backend took lands before the next tensor op."""

    def __init__(self):
        super().__init__()
        self.pending: list = []
        self.deferred = 0

    def land(self) -> None:
        while self.pending:
            self.pending.pop(0).wait()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", "").startswith("torch.distributed"):
            # the backend's own calls (isend dispatches here too) queue work; they wait for nothing
            return func(*args, **(kwargs or {}))
        if self.pending and func in HOST_READS:
            raise NotLanded(f"{func.__name__}() read a value on the host before the backend's data landed")
        self.land()
        return func(*args, **(kwargs or {}))


class Early:
    """A handle whose wait() returns before anything arrived."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return False


def _late(real, collective: bool):
    def call(*args, **kwargs):
        landing = getattr(_local, "landing", None)
        if landing is None:
            return real(*args, **kwargs)
        asked_async = kwargs.get("async_op", False)
        if collective:
            kwargs["async_op"] = True
        landing.pending.append(real(*args, **kwargs))
        landing.deferred += 1
        return Early() if (asked_async or not collective) else None
    return call


def _install_late_backend(monkeypatch) -> list[int]:
    """Late calls on every communication-thread job; returns the per-job deferred counts."""
    import pipesgd.comm.base as comm_base

    for name in ("irecv", "isend"):
        monkeypatch.setattr(dist, name, _late(getattr(dist, name), collective=False))
    for name in ("all_reduce", "all_gather", "broadcast"):
        monkeypatch.setattr(dist, name, _late(getattr(dist, name), collective=True))
    deferred: list[int] = []
    submit = comm_base.CommThread.submit

    def late_submit(self, fn):
        def job():
            landing = LateLanding()
            _local.landing = landing
            try:
                with landing:
                    out = fn()
            finally:
                landing.land()  # the done-event: whoever waits for the job waits for all of it
                _local.landing = None
            deferred.append(landing.deferred)
            return out
        return submit(self, job)

    monkeypatch.setattr(comm_base.CommThread, "submit", late_submit)
    return deferred


def _train(rank, world, late: bool, compressor: str, allreduce: str, staleness: str):
    from pipesgd import PipeSGD

    monkeypatch = pytest.MonkeyPatch()
    deferred = _install_late_backend(monkeypatch) if late else []
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        data = torch.Generator().manual_seed(10 + rank)
        with PipeSGD(opt, model.parameters(), width=2, compressor=compressor, allreduce=allreduce,
                     staleness=staleness, find_unused_parameters=True, timeout_s=60) as engine:
            for _ in range(6):
                opt.zero_grad()
                with engine.forward_context():
                    model(torch.randn(4, 12, generator=data)).square().mean().backward()
                engine.step()
            engine.flush()
            engine.check_replicas()
        return [p.detach().clone() for p in model.parameters()], deferred
    finally:
        monkeypatch.undo()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("compressor, allreduce, staleness", [
    ("none", "ring", "none"), ("int8", "ring", "lookahead"), ("none", "tree", "none"),
    ("none", "native", "dc"), ("topk", "ring", "none"), ("powersgd", "ring", "none"),
])
def test_training_is_bit_identical_when_wait_returns_before_the_data_lands(compressor, allreduce, staleness):
    blocking = run_workers(_train, 2, False, compressor, allreduce, staleness)
    late = run_workers(_train, 2, True, compressor, allreduce, staleness)
    for (want, _), (got, deferred) in zip(blocking, late):
        assert sum(deferred) > 0, "the fake deferred nothing: it tested nothing"
        for a, b in zip(want, got):
            assert torch.equal(a, b)


def _reads_after_wait(rank, world):
    """What code that trusts wait() would do: read the received value on the host."""
    from pipesgd.comm import CommThread

    monkeypatch = pytest.MonkeyPatch()
    _install_late_backend(monkeypatch)
    thread = CommThread()
    try:
        def job():
            got = torch.zeros(1)
            work = dist.irecv(got, 1 - rank) if rank == 0 else dist.isend(torch.ones(1), 0)
            work.wait()
            return got.item() if rank == 0 else None

        try:
            thread.submit(job).wait(60)
        except Exception as e:  # the thread names what it was doing: "...: NotLanded: item() ..."
            return str(e)
        return None
    finally:
        thread.close()
        monkeypatch.undo()


@pytest.mark.timeout(120)
def test_the_late_backend_catches_a_host_read_that_trusts_wait():
    message, sent = run_workers(_reads_after_wait, 2)
    assert "NotLanded: item() read a value on the host before the backend's data landed" in message
    assert sent is None
