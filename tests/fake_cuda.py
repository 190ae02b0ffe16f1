"""A fake of ``torch.cuda``'s devices, streams, events and caching allocator, as strict as CUDA is
where pipesgd has been wrong (tests/unit/test_streams.py, test_device.py).

``FakeCuda(monkeypatch)`` replaces ``torch.cuda.Event``/``Stream``/``current_stream``/``set_stream``/
``set_device``/``current_device`` and ``Tensor.record_stream``; ``torch.cuda.stream`` stays torch's
own ``StreamContext``, running on these. What it models:

* **Devices per thread.** A thread starts on device 0 (CUDA's runtime does), ``set_device`` and
  ``set_stream`` (as torch's ``_cuda_setStream`` does) make a device current, and every call that
  acts on a device (``set_device``, ``set_stream``, ``current_stream``, ``Stream(device=)``)
  notes it in :attr:`touched` under the thread's name: that is where a context is created.
* **Streams and events.** Each stream counts the operations run on it; an event records a
  stream's count; ``Stream.wait_event`` notes how far the waiting stream is ordered after the
  other. An event's time is its position in :attr:`log` (``elapsed_time`` in ms). With
  :attr:`device_done` cleared, events recorded on a non-default stream are not complete:
  ``query()`` says False and ``synchronize()`` blocks until it is set again, or, with
  :attr:`lands_when_waited`, the work lands (:meth:`FakeCuda.land`) when the host synchronizes
  on it or a stream waits on it, after :attr:`landing_ms` more ms of device time: a slow
  communication stream, whose stall shows on the training stream from where it started waiting.
  Events in :attr:`hung` never complete (their ``synchronize()`` blocks until :attr:`unhang`).
* **Allocator pools per stream** (inside :meth:`allocator`, a ``TorchDispatchMode`` the
  communication thread's jobs run in too): a tensor's storage belongs to the stream current when
  it was made; every operation on another stream that reads or writes it is a use there. When the
  storage is freed, each such use must be covered by ``record_stream`` on that stream or by the
  owning stream having waited on an event recorded after the use; otherwise the memory could be
  handed to the owning stream's next allocation while the other stream's work still used it, and
  the violation lands in :attr:`errors`.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import pipesgd.comm.base as comm_base


class FakeStream:
    def __init__(self, fake: FakeCuda, device: int, name: str):
        self.fake, self.device, self.name = fake, torch.device("cuda", device), name
        self.count = 0  # operations run on this stream so far
        self.waited: dict[FakeStream, int] = {}  # other stream -> how far this one is ordered after it

    @property
    def device_index(self) -> int:
        return self.device.index

    def wait_event(self, event) -> None:
        self.fake.log.append(("wait_event", self.name, event))
        if not event._complete() and self.fake.lands_when_waited:
            self.fake.land()  # this stream stalls here until the other's work ends
        if event.stream is not None and event.stream is not self:
            self.waited[event.stream] = max(self.waited.get(event.stream, 0), event.count)

    def __repr__(self) -> str:
        return f"<stream {self.name} on {self.device}>"


class _Block:
    def __init__(self, owner: FakeStream):
        self.owner = owner
        self.uses: dict[FakeStream, int] = {}  # other stream -> its count at the last use
        self.recorded: set[FakeStream] = set()


class _Pools(TorchDispatchMode):
    """One thread's view of the allocator: every operation is run on that thread's current stream."""

    def __init__(self, fake: FakeCuda):
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        stream = self.fake.stream_now()
        with self.fake.lock:
            stream.count += 1
            for t in tree_flatten((args, kwargs, out))[0]:
                if isinstance(t, torch.Tensor):
                    self.fake.use(t, stream)
        return out


class FakeCuda:
    def __init__(self, monkeypatch, devices: int = 2):
        self.log: list[tuple] = []
        self.touched: dict[str, set[int]] = defaultdict(set)
        self.errors: list[str] = []
        self.lock = threading.RLock()
        self.device_done = threading.Event()  # cleared: work on a non-default stream has not finished
        self.device_done.set()
        self.lands_when_waited = False  # with device_done cleared: synchronize() lets the work finish
        self.landing_ms = 0  # how long the unfinished work still runs once it lands (a slow comm stream)
        self.hung: set = set()  # events that never complete: synchronize() blocks until unhang is set
        self.unhang = threading.Event()
        self.devices = devices
        self._tls = threading.local()
        self.default = {d: FakeStream(self, d, "training") for d in range(devices)}  # each device's default stream
        self._blocks: dict[int, _Block] = {}
        self._finished: dict[FakeStream, int] = {}  # stream -> operations the host saw finish (synchronize)
        fake = self

        class Event:
            def __init__(self, enable_timing=False, blocking=False, interprocess=False):
                self.timing, self.blocking = enable_timing, blocking
                self.at, self.stream, self.count = None, None, 0

            def record(self, stream=None):
                stream = fake.current_stream() if stream is None else stream
                fake.touch(stream.device.index)
                self.at, self.stream, self.count = len(fake.log), stream, stream.count
                fake.log.append(("record", stream.name, self))

            def query(self):
                fake.log.append(("query", self))
                return self._complete()

            def _complete(self) -> bool:
                if self in fake.hung:
                    return False
                return fake.device_done.is_set() or self.stream is None or self.stream.name == "training"

            def synchronize(self):
                fake.log.append(("synchronize", self))
                if self in fake.hung:
                    fake.unhang.wait()
                    return
                if not self._complete():
                    if fake.lands_when_waited:
                        fake.land()
                    fake.device_done.wait()

            def elapsed_time(self, end):
                assert self.timing and end.timing, "elapsed_time needs enable_timing on both events"
                return float(end.at - self.at)  # ms

        def make_stream(device=None, priority=0, name="comm"):
            index = fake.current_device() if device is None else torch.device(device).index
            fake.touch(index)
            return FakeStream(fake, index, name)

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "Stream", make_stream)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(torch.cuda, "set_stream", self.set_stream)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "current_device", self.current_device)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)
        monkeypatch.setattr(torch.cuda, "_exchange_device", self._exchange)
        monkeypatch.setattr(torch.cuda, "_maybe_exchange_device", self._exchange)
        # torch.cuda.stream's StreamContext asks which device type is present before it does anything
        monkeypatch.setattr(torch._utils, "_get_available_device_type", lambda: "cuda")
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: self.record_stream(t, stream))
        run = comm_base.CommThread._run

        def run_in_pools(thread, fn):  # the communication thread's jobs allocate from the pools too
            with self.allocator():
                return run(thread, fn)

        monkeypatch.setattr(comm_base.CommThread, "_run", run_in_pools)

    def land(self) -> None:
        """The unfinished work on the non-default streams runs to its end now: ``landing_ms`` log
        entries (ms of device time) pass first, so an interval spanning a stall shows it."""
        with self.lock:
            if not self.device_done.is_set():
                self.log.extend([("comm kernels",)] * self.landing_ms)
                self.device_done.set()

    # --- devices, per thread ---
    def touch(self, index: int) -> None:
        self.touched[threading.current_thread().name].add(index)

    def current_device(self) -> int:
        return getattr(self._tls, "device", 0)  # a new thread starts on device 0

    def set_device(self, device) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        assert 0 <= index < self.devices, f"invalid device ordinal {index} ({self.devices} visible)"
        self.touch(index)
        self._tls.device = index
        self.log.append(("set_device", threading.current_thread().name, index))

    def _exchange(self, index: int) -> int:
        previous = self.current_device()
        if index >= 0:
            self.set_device(index)
        return previous

    def current_stream(self, device=None) -> FakeStream:
        index = self.current_device() if device is None else torch.device(device).index
        self.touch(index)
        return getattr(self._tls, "streams", {}).get(index, self.default[index])

    def stream_now(self) -> FakeStream:
        """This thread's current stream, as a kernel launched now would run on (touches nothing)."""
        index = self.current_device()
        return getattr(self._tls, "streams", {}).get(index, self.default[index])

    def set_stream(self, stream: FakeStream) -> None:
        """As torch's ``_cuda_setStream``: the stream's device becomes the thread's current device."""
        if stream is None:
            return
        self.touch(stream.device.index)
        self._tls.device = stream.device.index
        self.log.append(("set_stream", threading.current_thread().name, stream.name))
        if not hasattr(self._tls, "streams"):
            self._tls.streams = {}
        self._tls.streams[stream.device.index] = stream

    def synchronize(self, device=None) -> None:
        """The host waits for every stream (a checkpoint's copy to the CPU does too)."""
        with self.lock:
            self.log.append(("synchronize device",))
            for stream in {*self.default.values(), *self._streams()}:
                self._finished[stream] = stream.count

    def _streams(self) -> set[FakeStream]:
        return {s for b in self._blocks.values() for s in (b.owner, *b.uses)}

    # --- the caching allocator's pools ---
    @contextmanager
    def allocator(self):
        with _Pools(self):
            yield self

    def _block(self, t: torch.Tensor, stream: FakeStream) -> _Block:
        storage = t.untyped_storage()
        key = id(storage)
        block = self._blocks.get(key)
        if block is None:
            block = self._blocks[key] = _Block(stream)
            weakref.finalize(storage, self._free, key)
        return block

    def use(self, t: torch.Tensor, stream: FakeStream) -> None:
        block = self._block(t, stream)
        if stream is not block.owner:
            block.uses[stream] = stream.count

    def record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        with self.lock:
            self._block(t, self.stream_now()).recorded.add(stream)
            self.log.append(("record_stream", stream.name))

    def _free(self, key: int) -> None:
        with self.lock:
            block = self._blocks.pop(key)
            for stream, count in block.uses.items():
                if (stream in block.recorded or block.owner.waited.get(stream, 0) >= count
                        or self._finished.get(stream, 0) >= count):
                    continue
                self.errors.append(
                    f"a tensor made on the {block.owner.name} stream was freed while the {stream.name} stream's "
                    f"operation {count} used it, and the {block.owner.name} stream had waited only for its "
                    f"operation {block.owner.waited.get(stream, 0)}: its memory could go to the next allocation "
                    f"on {block.owner.name} while {stream.name} still reads it (record_stream, or make it on "
                    f"{stream.name})")

    def released(self) -> list[str]:
        """The allocator's errors once every tracked storage still alive is let go (end of a test)."""
        import gc
        gc.collect()
        return list(self.errors)
