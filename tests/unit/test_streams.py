"""The order of device work on a GPU, proven with a fake stream/event layer (pipesgd.comm.streams).

A recording :class:`FakeStreams` stands in for CUDA streams and events and logs, in real time and
in one list with the backend's calls, what each thread asked for. Over a pipelined run, for every
step's reduction: the training thread marks the flattened buffer ready before the communication
work waits on that mark, every backend call of the reduction comes after that wait and before
its done-mark, and the training thread waits on the done-mark before the optimizer reads the
average. On CUDA the same calls are events (``Event.record``, ``Stream.wait_event``): the CPU
never blocks for them.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from fake_dist import FakeDist
from torch import nn

import pipesgd.engine.exchange as exchange
from pipesgd.comm.streams import CudaStreams, HostStreams, streams_for
from pipesgd.engine.pipe import PipeSGD


class FakeStreams:
    def __init__(self, log: list):
        self.log, self.ids = log, itertools.count()

    def ready(self, *tensors):
        mark = next(self.ids)
        self.log.append(("ready", mark, tensors))
        return mark

    def run(self, ready, fn):
        self.log.append(("comm waits", ready))
        out = fn()
        self.log.append(("done", ready))
        return out, ready

    def wait(self, done):
        self.log.append(("training waits", done))


def pipelined_run(monkeypatch, width: int, compressor: str, steps: int = 5) -> list:
    fake = FakeDist(2, 0, "gloo").install(monkeypatch)
    log = fake.calls  # one list: the streams' marks and the backend's calls, in the order they happened
    monkeypatch.setattr(exchange, "streams_for", lambda device: FakeStreams(log))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.register_step_pre_hook(lambda *_: log.append(("optimizer.step",)))
    with PipeSGD(opt, model.parameters(), width=width, compressor=compressor) as engine:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(3, 4)).square().sum().backward()
            log.append(("step",))
            engine.step()
        engine.flush()
    return log


def where(log: list, *entry) -> int:
    (i,) = [i for i, e in enumerate(log) if e[:len(entry)] == entry]
    return i


@pytest.mark.parametrize("width", [1, 2, 3])
@pytest.mark.parametrize("compressor", ["none", "int8", "topk", "powersgd"])
def test_comm_work_waits_for_the_flatten_and_the_update_waits_for_the_comm_work(monkeypatch, width, compressor):
    log = pipelined_run(monkeypatch, width, compressor)
    marks = [e[1] for e in log if e[0] == "ready"]
    assert len(marks) == 5
    backend = {"isend", "irecv", "all_reduce", "all_gather", "batch_isend_irecv", "send", "recv"}
    updates = [i for i, e in enumerate(log) if e[0] == "optimizer.step"]
    assert len(updates) == 5
    for n, mark in enumerate(marks):
        ready, waits, done, applied = (where(log, "ready", mark), where(log, "comm waits", mark),
                                       where(log, "done", mark), where(log, "training waits", mark))
        assert ready < waits < done < applied
        calls = [i for i, e in enumerate(log) if e[0] in backend and waits < i < done]
        assert calls, "the reduction's messages run between the comm stream's wait and its done-mark"
        buf = log[ready][2][0]
        shares = [t for i in calls for t in log[i][1]
                  if t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()]
        if compressor == "none":
            assert shares, "the marked buffer is the one the reduction sends"
        # The n-th update applies the n-th reduction, after the training stream waited for it.
        assert applied < updates[n]
        assert n == 0 or updates[n - 1] < applied
    # Nothing of a step's reduction is waited for before that step is launched.
    steps = [i for i, e in enumerate(log) if e[0] == "step"]
    for n, mark in enumerate(marks):
        assert steps[n] < where(log, "ready", mark)
        assert where(log, "training waits", mark) > steps[min(n + width - 1, len(steps) - 1)]


def test_the_default_ordering_follows_the_parameters_device():
    assert isinstance(streams_for(torch.device("cpu")), HostStreams)
    cuda = streams_for(torch.device("cuda", 1))  # no CUDA call until the first reduction
    assert isinstance(cuda, CudaStreams) and cuda.device == torch.device("cuda", 1) and cuda._stream is None


def test_host_streams_run_the_job_and_order_nothing():
    s = HostStreams()
    mark = s.ready(torch.zeros(2))
    assert s.run(mark, lambda: 7) == (7, None)
    assert s.wait(None) is None
