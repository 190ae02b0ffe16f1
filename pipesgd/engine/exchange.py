"""WHAT is communicated: the gradients of a parameter list, flattened into one of the exchange's
own flat buffers (the double buffering Pipe-SGD needs), reduced on the communication thread, with
a non-finite flag every rank reads alike. docs/reliability.md ("NaN and inf") says how the flag
rides the reduction.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from ..observability import trace
from ..comm import CommStats, CommThread, CompletedHandle, Handle, bind, note
from ..comm.p2p import backend_of
from ..comm.streams import OrderedHandle, Streams, streams_for
from ..flat import flag_overflow, flatten_grads, mark_nonfinite
from ..reduction import Spec, as_reduction, resolve

T = TypeVar("T")


@dataclass
class Reduced:
    """The averaged gradient of one step, flat, in parameter order, plus what moving it cost, the
    reduced non-finite flag (None: not known, e.g. built by hand) and whether this rank's own
    gradient was non-finite."""

    flat: Tensor
    stats: CommStats
    flag: Tensor | None = None
    local_nonfinite: Tensor | bool = False
    control: Tensor | None = None  # the summed control vector of this step (PipeSGD.join, find_unused_parameters)

    @property
    def nonfinite(self) -> bool:
        """Whether any rank's gradient had a NaN/inf: the same answer on every rank. Reads one
        value (a device sync on GPU, where the update needs the buffer anyway)."""
        return self.flag is not None and bool(self.flag.item() != 0)


def _require_process_group() -> None:
    """A launcher that says WORLD_SIZE > 1 without a process group would leave every rank training
    alone at world size 1, silently (DDP raises here too)."""
    world = os.environ.get("WORLD_SIZE", "1")
    if world.strip() not in ("", "0", "1") and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"WORLD_SIZE={world} in the environment (torchrun?) but no torch.distributed process group: "
            "call torch.distributed.init_process_group(...) before creating the engine, or unset "
            "WORLD_SIZE to train a lone process")


class GradientExchange:
    """WHAT one engine communicates: its parameters' gradients, flattened, handed to the reduction
    the compressor spec resolves to, over the allreduce bound to it and ``group``'s backend
    (comm=auto picks one here), on one comm thread.
    ``streams`` orders the device work (:mod:`pipesgd.comm.streams`; default: by the parameters'
    device, a communication stream on CUDA, nothing on the CPU); ``thread``, the communication
    thread (default: one of its own, started at the first job)."""

    def __init__(self, params: Iterable[Tensor], compressor: Spec, allreduce: Callable[..., CommStats], group=None,
                 streams: Streams | None = None, thread: CommThread | None = None):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("params has no tensor with requires_grad=True: nothing to reduce")
        _require_process_group()
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"params must share one dtype, got {sorted(map(str, dtypes))}")
        devices = {p.device for p in self.params}
        if len(devices) != 1:
            raise ValueError(f"params must live on one device, got {sorted(map(str, devices))}")
        self.compressor = resolve(compressor)  # the one place a spec is resolved
        self.allreduce = bind(allreduce, self.compressor, backend_of(group))
        self.group = group
        self.numel = sum(p.numel() for p in self.params)
        self.flat_numel = self.numel + 1  # gradients + the non-finite flag slot
        self.reduction = as_reduction(self.compressor)
        # An in-ring compressor is checked against what the allreduce declares it carries, here.
        self.reduction.bind([p.shape for p in self.params], self.allreduce, self.params[0].device)
        self._flag_rides = self.reduction.carries_flag
        # ``thread``: a communication thread shared with other exchanges over the same group (one
        # FIFO keeps their collectives in one order on every rank); the caller closes it
        self._thread: CommThread | None = thread
        self._owns_thread = thread is None
        self._free: list[Tensor] = []  # flat buffers for flatten() to reuse (release)
        # flat buffers handed out and not released, by storage; weak, so a caller that never
        # releases (a benchmark driving launch() alone) leaves them to the garbage collector
        self._lent: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()
        self.streams = streams_for(self.params[0].device) if streams is None else streams

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1

    def flatten(self) -> Tensor:
        """The current gradients, flat (missing ``.grad`` counts as zeros), followed by the flag
        slot: ``flat_numel`` values; ``[:-1]`` is the gradient. The buffer is one of this exchange's
        own (:meth:`release`): the one the gradients already are (:meth:`_viewed`), else a copy into
        one no gradient points into."""
        buf = self._viewed()
        if buf is None:
            buf = self._buffer()
            flatten_grads(self.params, buf[:-1])
        buf[-1:].zero_()
        return buf

    def _viewed(self) -> Tensor | None:
        """A released buffer the gradients already are, laid out as :meth:`flatten` would copy
        them, lent again as it is: a loop that zeroes gradients in place (``zero_grad(set_to_none=
        False)``) leaves them views of the last applied average, and backward accumulates into them
        there, so the step copies nothing (DDP's ``gradient_as_bucket_view``)."""
        first = self.params[0].grad
        if first is None or not self._free:
            return None
        ptr = first.untyped_storage().data_ptr()
        for i, b in enumerate(self._free):
            if b.untyped_storage().data_ptr() == ptr:
                break
        else:
            return None
        offset = b.storage_offset()
        for p in self.params:
            g = p.grad
            if (g is None or g.untyped_storage().data_ptr() != ptr or g.storage_offset() != offset
                    or g.shape != p.shape or not g.is_contiguous()):
                return None
            offset += p.numel()
        buf = self._free.pop(i)
        self._lent[ptr] = buf
        return buf

    def zeros(self) -> Tensor:
        """A flat buffer as :meth:`flatten` returns, all zeros: a joined rank's contribution."""
        return self._buffer().zero_()

    def release(self, flat: Tensor) -> None:
        """The caller is done with a reduced buffer (``Reduced.flat``, from :meth:`launch`): it is
        reused by a later :meth:`flatten` once no parameter's ``.grad`` points into it (the update
        made them views of it; ``zero_grad(set_to_none=True)`` lets go of them). Buffers this
        exchange did not make (restored from a checkpoint) are not kept."""
        buf = self._lent.pop(flat.untyped_storage().data_ptr(), None)
        if buf is not None:
            self._free.append(buf)

    def _buffer(self) -> Tensor:
        """A flat buffer of ``flat_numel`` values, lent until :meth:`release`: a free one that no
        ``.grad`` views, else a new one. A pipeline of width K keeps K of them in steady state: no
        allocation per step, and on a GPU no buffer freed while the communication stream may still
        use it."""
        viewed = {p.grad.untyped_storage().data_ptr() for p in self.params if p.grad is not None}
        for i, b in enumerate(self._free):
            if b.untyped_storage().data_ptr() not in viewed:
                buf = self._free.pop(i)
                break
        else:
            buf = torch.empty(self.flat_numel, dtype=self.params[0].dtype, device=self.params[0].device)
        self._lent[buf.untyped_storage().data_ptr()] = buf
        return buf

    def launch(self, buf: Tensor | None = None, control: Tensor | None = None,
               reduced_control: Tensor | None = None) -> Handle[Reduced]:
        """Start averaging ``buf`` (default: :meth:`flatten`; gradients then the flag slot) across
        ranks, after setting its flag (:func:`mark_nonfinite`); never blocks. ``control`` (int64)
        is summed across ranks first, in the same job (``Reduced.control``); ``reduced_control``
        is a control vector already summed (by :meth:`control_round`), passed through."""
        buf = self.flatten() if buf is None else buf
        self._let_go(buf)
        bad = mark_nonfinite(buf)
        world = self.world_size
        if world == 1:
            return CompletedHandle(Reduced(buf[:-1], CommStats(), buf[-1:], bad,
                                           control if reduced_control is None else reduced_control))
        ready = self.streams.ready(buf, bad, *(() if control is None else (control,)))  # after the flatten and the flag, on the training stream

        def reduce() -> Reduced:
            summed = reduced_control
            if control is not None:
                note("all_reduce of the control vector (join / unused parameters)")
                dist.all_reduce(control, group=self.group)
                summed = control
            if self._flag_rides:
                stats = self.reduction.reduce(buf, self.group)
            else:
                # A stateful reduction must not absorb a NaN into its residual / warm start, or
                # every later step would be non-finite too: such a rank contributes zeros (the flag
                # still makes every rank drop this step). One pass, on this thread.
                buf[:-1].masked_fill_(bad, 0.0)
                stats = self.reduction.reduce(buf[:-1], self.group)
                note("all_reduce of the non-finite flag")
                dist.all_reduce(buf[-1:], group=self.group)
            with trace.current().span("average", "comm"):
                buf.div_(world)
                flag_overflow(buf)  # the average is non-finite on every rank alike: the flag says so too
            return Reduced(buf[:-1], stats, buf[-1:], bad, summed)

        return OrderedHandle(self._submit(lambda: self.streams.run(ready, reduce)), self.streams)

    def _let_go(self, buf: Tensor) -> None:
        """No ``.grad`` may view a buffer lent to a reduction: the caller's next in-place ``zero_()``
        and backward would write into what the communication thread reduces, or into an average
        still waiting to be applied. Gradients that are ``buf`` (:meth:`_viewed`) become None; the
        update that applies an average points them at it again (a skipped one too)."""
        ptr = buf.untyped_storage().data_ptr()
        for p in self.params:
            if p.grad is not None and p.grad.untyped_storage().data_ptr() == ptr:
                p.grad = None

    @property
    def activity(self) -> str | None:
        """What the communication thread is blocked on right now, if anything."""
        return None if self._thread is None else self._thread.activity

    def run(self, fn: Callable[[], T], what: str, timeout: float | None = None) -> T:
        """``fn`` on the communication thread after whatever is queued there; its result."""
        if self.world_size == 1:
            return fn()

        def job() -> T:
            note(what)
            return fn()

        return self.ordered(job).wait(timeout)

    def gather(self, value: int) -> list[int]:
        """``value`` of every rank of the group, in rank order. Runs on the communication thread,
        after whatever is already queued there, so call it at the same point on every rank."""
        mine = torch.tensor([value], dtype=torch.int64, device=self.params[0].device)
        return [int(t.item()) for t in self.gather_tensor(mine)]

    def gather_tensor(self, mine: Tensor, timeout: float | None = None) -> list[Tensor]:
        """``mine`` (same shape and dtype on every rank) of every rank of the group, in rank order,
        gathered on the communication thread after whatever is already queued there."""
        if self.world_size == 1:
            return [mine]
        out = [torch.empty_like(mine) for _ in range(self.world_size)]

        def job() -> list[Tensor]:
            note("all_gather on the engine's group")
            dist.all_gather(out, mine, group=self.group)
            return out

        return self.ordered(job, mine, *out).wait(timeout)

    def control_round(self, control: Tensor) -> Handle[Tensor]:
        """Sum ``control`` across ranks on the communication thread, alone (a joined rank asks
        whether anyone still trains before it shadows a step)."""
        if self.world_size == 1:
            return CompletedHandle(control)

        def job() -> Tensor:
            note("all_reduce of the control vector (join)")
            dist.all_reduce(control, group=self.group)
            return control

        return self.ordered(job, control)

    def ordered(self, job: Callable[[], T], *inputs: Tensor) -> Handle[T]:
        """``job`` on the communication thread and stream, after the training stream's work on
        ``inputs``; waiting on the handle orders the training stream after it."""
        ready = self.streams.ready(*inputs)
        return OrderedHandle(self._submit(lambda: self.streams.run(ready, job)), self.streams)

    def _submit(self, job: Callable[[], T]) -> Handle[T]:
        if self._thread is None:
            self._thread = CommThread()
        return self._thread.submit(job)

    def state_dict(self) -> dict:
        """The reduction's state (error-feedback residuals, warm starts). Call with nothing in flight."""
        return self.reduction.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Loaded on the communication thread and stream: the residuals and warm starts are cloned
        there, so on a GPU their memory belongs to the stream that reads and frees them (cloned on
        the training stream, it could go to a forward while a reduction still reads it)."""
        tensors = [t for t in _tensors(state) if t.device == self.params[0].device]
        if self.world_size == 1:
            self.reduction.load_state_dict(state)
            return

        def load() -> Exception | None:
            try:
                self.reduction.load_state_dict(state)
            except (KeyError, ValueError) as e:  # a checkpoint that does not fit: the caller's error,
                return e                         # not a failed reduction poisoning the thread
            return None

        error = self.ordered(load, *tensors).wait()
        if error is not None:
            raise error

    def close(self) -> None:
        if self._thread is not None and self._owns_thread:
            self._thread.close()
        self._thread = None


def _tensors(state) -> list[Tensor]:
    """Every tensor inside ``state`` (dicts, lists, tuples)."""
    if isinstance(state, Tensor):
        return [state]
    if isinstance(state, dict):
        state = list(state.values())
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []
