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
from fake_cuda import FakeCuda
from fake_dist import FakeDist
from torch import nn

import pipesgd.engine.exchange as exchange
from pipesgd.compress import get_compressor
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

    def begin_wait(self):
        return None

    def wait(self, done, timeout=None, begun=None):
        self.log.append(("training waits", done))

    def span(self, done):
        return None


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


def ops(fake: FakeCuda, *kinds: str) -> list[tuple]:
    return [e[:2] for e in fake.log if e[0] in kinds]


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
    assert ops(fake, "record", "wait_event", "kernels") == [
        ("record", "training"), ("wait_event", "comm"), ("record", "comm"), ("kernels",), ("kernels",),
        ("record", "comm"), ("record", "training"), ("wait_event", "training"), ("record", "training")]
    waits = [e[2] for e in fake.log if e[0] == "wait_event"]
    assert waits == [ready, done.end]  # each stream waits on the other's mark
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


def test_a_deadline_covers_the_device_work_without_ever_sleeping(monkeypatch):
    """On a GPU the communication thread returns once the work is queued, and a silent peer hangs
    the device instead: waiting with a timeout covers the device work. Work already done costs one
    query; work still running is waited for by blocking (no poll, no sleep: a poll's pause is
    wake-up latency exactly when the communication is exposed), and never past the deadline."""
    from pipesgd.comm import streams
    from pipesgd.comm.base import CompletedHandle
    from pipesgd.comm.streams import OrderedHandle

    def no_sleep(seconds):
        raise AssertionError(f"waiting for the device slept {seconds} s")

    monkeypatch.setattr(streams.time, "sleep", no_sleep)
    fake = FakeCuda(monkeypatch)
    s = CudaStreams(torch.device("cuda", 0))

    def waited(timeout):
        value, done = s.run(s.ready(), lambda: "average")
        before = len(fake.log)
        out = OrderedHandle(CompletedHandle((value, done)), s).wait(timeout=timeout)
        return out, [e[0] for e in fake.log[before:] if e[0] in ("query", "synchronize")]

    assert waited(5) == ("average", ["query"])  # hidden: done already, one query
    fake.device_done.clear()
    fake.lands_when_waited = True
    assert waited(5) == ("average", ["query", "synchronize"])  # exposed: one blocking wait, no poll
    fake.device_done.clear()
    fake.lands_when_waited = False
    try:
        with pytest.raises(TimeoutError, match="device work"):
            waited(0.05)  # hung: the deadline holds
    finally:
        fake.device_done.set()  # lets the waiter thread go
    assert waited(None) == ("average", [])  # no deadline: nothing is asked (the flag's read waits anyway)


def cuda_engine_run(monkeypatch, fake: FakeCuda, compressor, device: int = 1, width: int = 2, steps: int = 4,
                    resume: bool = False):
    """PipeSGD over 2 fake NCCL ranks with its streams on fake ``cuda:<device>`` (the tensors stay on
    the CPU), inside the fake allocator; with ``resume``, its state is loaded into a second engine
    that trains on. Returns the engines' flat weights."""
    FakeDist(2, 0, "nccl").install(monkeypatch)
    torch.cuda.set_device(device)  # as pipesgd.dist.init does on the training thread
    monkeypatch.setattr(exchange, "streams_for", lambda d: CudaStreams(torch.device("cuda", device)))
    with fake.allocator():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 3))  # PowerSGD compresses the first
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def train(engine, n):
            for _ in range(n):
                opt.zero_grad()
                model(torch.randn(4, 32)).square().sum().backward()
                engine.step()

        engine = PipeSGD(opt, model.parameters(), width=width, compressor=compressor, timeout_s=30)
        train(engine, steps)
        engine.check_replicas()
        if resume:
            state = engine.state_dict()
            torch.cuda.synchronize()  # a checkpoint's copy to the CPU waits for the device
            engine.flush()
            engine.close()
            engine = PipeSGD(opt, model.parameters(), width=width, compressor=compressor, timeout_s=30)
            engine.load_state_dict(state)
            del state
            train(engine, steps)
        engine.flush()
        engine.close()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("compressor", ["none", "int8", "powersgd"])
def test_the_communication_thread_touches_only_the_engines_device(monkeypatch, compressor):
    """A thread starts on device 0: a communication thread that never set its device made GPU 0
    current (and created a context there) on every rank, when leaving torch.cuda.stream restored
    its previous stream. It sets its device once, before anything else."""
    fake = FakeCuda(monkeypatch, devices=2)
    cuda_engine_run(monkeypatch, fake, compressor, device=1)
    assert fake.touched["pipesgd-comm"] == {1}
    assert [e for e in fake.log if e[:2] == ("set_device", "pipesgd-comm")] == [("set_device", "pipesgd-comm", 1)]
    assert fake.touched["MainThread"] == {1}
    assert set(fake.touched) <= {"MainThread", "pipesgd-comm", "pipesgd-device-wait"}
    assert fake.touched.get("pipesgd-device-wait", {1}) == {1}


@pytest.mark.timeout(60)
def test_a_hung_event_does_not_fail_the_waits_after_it(monkeypatch):
    """Before the fix, the one waiter thread stayed blocked on a hung event, so every later
    wait queued behind it and timed out, whatever its own event did."""
    fake = FakeCuda(monkeypatch)
    s = CudaStreams(torch.device("cuda", 0))
    _, stuck = s.run(s.ready(), lambda: None)
    _, later = s.run(s.ready(), lambda: None)
    fake.device_done.clear()
    fake.lands_when_waited = True  # the later work finishes once waited for
    fake.hung.add(stuck.end)
    try:
        with pytest.raises(TimeoutError):
            s.finish(stuck, 0.05)
        s.finish(later, 5)  # lands: no TimeoutError
    finally:
        fake.unhang.set()


def test_the_device_waiter_sets_its_device_too(monkeypatch):
    fake = FakeCuda(monkeypatch, devices=2)
    torch.cuda.set_device(1)
    s = CudaStreams(torch.device("cuda", 1))
    _, done = s.run(s.ready(), lambda: None)
    fake.device_done.clear()
    fake.lands_when_waited = True
    s.finish(done, 5)
    assert fake.touched["pipesgd-device-wait"] == {1}


def test_the_fake_allocator_catches_memory_freed_under_another_streams_feet(monkeypatch):
    """The control for the allocator model: a tensor made on the training stream, used by the
    communication stream and let go before the training stream waited for that use, is an error;
    record_stream (what ready() does for the tensors it is given) or a wait covers it."""
    fake = FakeCuda(monkeypatch)
    s = CudaStreams(torch.device("cuda", 0))
    with fake.allocator():
        t = torch.ones(3)
        s.run(s.ready(), lambda: t.add_(1))
        del t
        assert len(fake.released()) == 1 and "freed while the comm stream" in fake.errors[0]
        fake.errors.clear()
        t = torch.ones(3)
        s.run(s.ready(t), lambda: t.add_(1))  # recorded
        u = torch.ones(3)
        _, done = s.run(s.ready(), lambda: u.add_(1))
        s.wait(done)  # the training stream is ordered after the use
        del t, u
        assert fake.released() == []


@pytest.mark.parametrize("compressor", ["powersgd", "topk", "int8+ef"])
@pytest.mark.parametrize("resume", [False, True], ids=["start", "resume"])
def test_reduction_state_is_never_freed_under_the_communication_streams_feet(monkeypatch, compressor, resume):
    """PowerSGD's warm start (made at bind on the training stream) and, after a resume, every
    residual and Q (cloned on the training stream) are read and replaced on the communication
    stream: made where they are read, their memory never goes to a forward while a reduction reads it."""
    fake = FakeCuda(monkeypatch)
    if compressor == "int8+ef":
        compressor = get_compressor("int8", error_feedback=True)
    cuda_engine_run(monkeypatch, fake, compressor, device=0, resume=resume)
    assert fake.released() == []


def test_a_hung_device_reduction_fails_the_step_naming_it(monkeypatch):
    FakeDist(2, 0, "gloo").install(monkeypatch)

    class Hung(FakeStreams):
        def wait(self, done, timeout=None, begun=None):
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


@pytest.mark.parametrize("rank", [0, 1], ids=["server", "worker"])
def test_ps_sync_times_its_round_on_the_device(monkeypatch, rank):
    """On a GPU ps_sync's messages are only queued when wait() returns: wall-clock times came out
    near zero. Its communication and exposed times are the stream's, as PipeSGD's are: a span
    from before the round's first message to after its last arrival, read lazily."""
    from pipesgd.comm import streams
    from pipesgd.comm.streams import CudaClock
    from pipesgd.engine.ps import ParameterServerEngine

    fake = FakeCuda(monkeypatch)
    backend = FakeDist(3, rank, "nccl").install(monkeypatch)
    record = backend._record
    monkeypatch.setattr(backend, "_record", lambda call, tensors: (fake.log.append(("backend", call)),
                                                                  record(call, tensors))[1])
    # the parameters stay on the CPU; the round is timed as on cuda:0
    monkeypatch.setattr(streams, "device_clock", lambda device: CudaClock(torch.device("cuda", 0)), raising=False)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ParameterServerEngine(opt, get_compressor("int8"))
    model(torch.randn(2, 4)).sum().backward()
    stats = engine.step()
    (span,) = stats.wait_spans
    assert stats.comm.spans == (span,)
    backend_at = [i for i, e in enumerate(fake.log) if e[0] == "backend"]
    assert span.start.at < backend_at[0] < span.end.at  # the server's reply goes out after the round
    assert not any(e[0] == "synchronize" for e in fake.log), "read lazily"
    assert stats.exposed_s() == stats.comm.time_s() == (span.end.at - span.start.at) / 1e3



@pytest.mark.parametrize("timeout", [5.0, None])
def test_a_host_wait_for_a_blocking_transport_counts_as_exposed(monkeypatch, timeout):
    """On Gloo (CUDA tensors too) the communication thread returns only once the bytes have
    moved, so the training thread's host wait for that thread is where its stream runs dry: the
    stall counts from before it (recorded after it, the stall read ~0 on Gloo, with a deadline or
    without)."""
    from pipesgd.comm.streams import OrderedHandle

    fake = FakeCuda(monkeypatch, devices=1)
    s = CudaStreams(torch.device("cuda", 0))
    value, done = s.run(s.ready(), lambda: "average")

    class Blocking:  # the communication thread's handle: 30 ms of Gloo moving bytes
        def wait(self, timeout=None):
            fake.log.extend([("gloo moves the bytes",)] * 30)
            return value, done

    handle = OrderedHandle(Blocking(), s)
    assert handle.wait(timeout) == "average"
    assert handle.spans[1].seconds() >= 30 / 1e3
