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
from pipesgd.engine.base import ReductionError
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

    def span(self, done):
        return None

    def finish(self, done, timeout):
        self.log.append(("finished", done))


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


class FakeCuda:
    """torch.cuda's streams and events as a log of what was asked, in order; an event's time is
    its position in the log, so ``elapsed_time`` between two records is the work queued between."""

    def __init__(self, monkeypatch):
        self.log: list[tuple] = []
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                self.timing, self.at = enable_timing, None

            def record(self, stream):
                self.at = len(fake.log)
                fake.log.append(("record", stream.name, self))

            def synchronize(self):
                fake.log.append(("synchronize", self))

            def elapsed_time(self, end):
                assert self.timing and end.timing, "elapsed_time needs enable_timing on both events"
                return float(end.at - self.at)  # ms

        class Stream:
            def __init__(self, device=None, name="comm"):
                self.name = name

            def wait_event(self, event):
                fake.log.append(("wait_event", self.name, event))

        self.training = Stream(name="training")

        class StreamContext:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                fake.log.append(("enter", self.stream.name))

            def __exit__(self, *exc):
                fake.log.append(("exit", self.stream.name))

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.training)
        monkeypatch.setattr(torch.cuda, "stream", StreamContext)


def test_cuda_streams_time_the_reduction_and_the_stall_with_events_read_lazily(monkeypatch):
    fake = FakeCuda(monkeypatch)
    s = CudaStreams(torch.device("cuda", 0))
    ready = s.ready()

    def reduction():
        fake.log.extend([("kernels",), ("kernels",)])
        return 5

    out, done = s.run(ready, reduction)
    assert out == 5
    comm = s.span(done)
    stall = s.wait(done)
    ops = [e[:2] for e in fake.log]
    assert ops == [("record", "training"), ("enter", "comm"), ("wait_event", "comm"), ("record", "comm"),
                   ("kernels",), ("kernels",), ("record", "comm"), ("exit", "comm"),
                   ("record", "training"), ("wait_event", "training"), ("record", "training")]
    assert fake.log[2][2] is ready and fake.log[9][2] is done.end  # each stream waits on the other's mark
    assert not any(e[0] == "synchronize" for e in fake.log), "nothing blocks the host until a span is read"
    # the reduction: from after the ready-wait to after its kernels; the stall brackets the wait
    assert comm.seconds() == 3 / 1e3 and stall.seconds() == 2 / 1e3
    assert [e[1] for e in fake.log if e[0] == "synchronize"] == [done.end, stall.end]


def test_the_cuda_clock_times_the_current_stream_without_a_sync(monkeypatch):
    from pipesgd.comm.streams import CudaClock, HostClock, clock_for
    fake = FakeCuda(monkeypatch)
    clock = clock_for(torch.device("cuda", 0))
    assert isinstance(clock, CudaClock) and isinstance(clock_for(torch.device("cpu")), HostClock)
    mark = clock.start()
    fake.log.append(("forward",))
    span = clock.stop(mark)
    assert [e[:2] for e in fake.log] == [("record", "training"), ("forward",), ("record", "training")]
    assert span.seconds() == 2 / 1e3 and fake.log[-1] == ("synchronize", span.end)


def test_a_deadline_covers_the_device_work_on_cuda_not_only_its_queueing(monkeypatch):
    """On a GPU the communication thread returns once the work is queued, and a silent peer hangs
    the device instead: waiting with a timeout polls the done-event (no synchronize, which could
    not be interrupted) and gives up after the deadline."""
    from pipesgd.comm.base import CompletedHandle
    from pipesgd.comm.streams import OrderedHandle
    fake = FakeCuda(monkeypatch)
    s = CudaStreams(torch.device("cuda", 0))
    value, done = s.run(s.ready(), lambda: "average")
    finished = {"at": None}
    polls = []

    def query():
        polls.append(1)
        return finished["at"] is not None and len(polls) >= finished["at"]

    done.end.query = query
    with pytest.raises(TimeoutError, match="device work"):
        OrderedHandle(CompletedHandle((value, done)), s).wait(timeout=0.05)
    assert len(polls) > 1 and not any(e[0] == "synchronize" for e in fake.log)
    finished["at"] = len(polls) + 3  # lands three polls later
    assert OrderedHandle(CompletedHandle((value, done)), s).wait(timeout=5) == "average"
    n = len(polls)
    assert OrderedHandle(CompletedHandle((value, done)), s).wait() == "average"
    assert len(polls) == n  # no deadline, no polling: the flag's read waits anyway


def test_a_hung_device_reduction_fails_the_step_naming_it(monkeypatch):
    FakeDist(2, 0, "gloo").install(monkeypatch)

    class Hung(FakeStreams):
        def finish(self, done, timeout):
            raise TimeoutError("the communication thread had queued it, but its device work (NCCL) did not finish")

    monkeypatch.setattr(exchange, "streams_for", lambda device: Hung([]))
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PipeSGD(opt, model.parameters(), width=1, timeout_s=0.5)
    model(torch.randn(2, 3)).sum().backward()
    with pytest.raises(ReductionError,
                       match=r"step 1's gradient \(waited for at step 1\) did not finish within 0.5 s; the "
                             r"communication thread had queued it, but its device work \(NCCL\) did not finish"):
        engine.step()
    engine.close()
