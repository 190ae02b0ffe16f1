"""Parameter-server training (``trainer.mode=ps_sync`` and ``ps_async``) over point-to-point messages.

Rank 0 of the engine's group is the server AND a worker; docs/modes.md ("Parameter server") gives
the placement, both update rules and the timing. Wire protocol on ``group`` (async): worker ->
server an ``int64[1]`` header (0 push, 1 done), then the compressed payload when pushing; server ->
worker the fp32 weights. Sync needs no header.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..comm import CommStats, streams
from ..comm.p2p import batched, post, uses_nccl
from ..compress import Compressor, Ctx
from ..modes import register
from .base import Engine, ModeArgs, StepStats

log = logging.getLogger(__name__)

SERVER_RANK = 0
_PUSH, _DONE = 0, 1
ASYNC_NEEDS_ANY_SOURCE = (
    "trainer.mode=ps_async cannot run on NCCL: its server receives from whichever worker pushes first "
    "(a receive from any source), which NCCL does not support; use dist.backend=gloo, or trainer.mode=ps_sync "
    "(which receives from each worker in turn)")


class _Server:
    """Master weights as views into one flat buffer (sent as is), and the server's optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[Tensor]):
        self.client = optimizer
        self.flat = torch.cat([p.detach().reshape(-1).float() for p in params])
        masters, offset = {}, 0
        for p in params:
            n = p.numel()
            masters[p] = self.flat[offset:offset + n].view_as(p).requires_grad_()
            offset += n
        self.masters = list(masters.values())
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [masters[p] for p in g["params"] if p in masters]} for g in optimizer.param_groups]
        self.optimizer = type(optimizer)(groups)
        self.version = 0
        self.lock = threading.Lock()

    def apply(self, grad: Tensor) -> None:
        """One ``optimizer.step()`` on the masters with ``grad`` (flat, parameter order); caller holds
        ``lock`` when other threads may apply. Options (lr from the schedule) follow the client's."""
        for mine, theirs in zip(self.optimizer.param_groups, self.client.param_groups):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
        offset = 0
        for m in self.masters:
            n = m.numel()
            m.grad = grad[offset:offset + n].view_as(m)
            offset += n
        self.optimizer.step()
        self.version += 1


class ParameterServerEngine(Engine):
    """Parameter-server training behind the engine contract. ``step()`` after each backward pushes
    this rank's gradient and leaves this rank's parameters holding the server's weights (sync: after
    the update of this step; async: whatever the server has at the reply). ``StepStats.comm`` counts
    this rank's gradient push (compressed bytes vs fp32; on rank 0 the in-process push); pulls are
    M fp32 bytes per remote worker and step. ``nonfinite`` is None: the ranks do not decide a
    non-finite gradient together, so a non-finite loss stops its own rank.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, compressor: Compressor, group=None,
                 asynchronous: bool = False):
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if not self.params:
            raise ValueError("the optimizer has no parameter with requires_grad=True: nothing to train")
        if {p.dtype for p in self.params} != {torch.float32}:
            raise ValueError("parameter-server modes train fp32 parameters only")
        self.group, self.compressor, self.asynchronous = group, compressor, asynchronous
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        mode = "ps_async" if asynchronous else "ps_sync"
        if self.world < 2:
            raise ValueError(f"trainer.mode={mode} needs >= 2 processes (dist.nproc), got {self.world}")
        if asynchronous and uses_nccl(group):
            raise ValueError(ASYNC_NEEDS_ANY_SOURCE)
        self.rank = dist.get_rank(group)
        self.numel = sum(p.numel() for p in self.params)
        self.device = self.params[0].device  # every buffer handed to the backend lives here
        self._batch = batched(group)  # ps_sync's rounds as one batch each on NCCL (pipesgd.comm.p2p)
        # On a GPU a round's messages are only queued when wait() returns: time them on the stream
        self._clock = streams.device_clock(self.device)
        self.ctx = Ctx((self.numel,), torch.float32, self.device)
        self.identity = compressor.identity
        self.server = _Server(optimizer, self.params) if self.rank == SERVER_RANK else None
        self.steps = 0
        self.last = StepStats()
        self._weights = torch.empty(self.numel, device=self.device)  # receive buffer for pulls (workers)
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._own_version = 0
        self._staleness: list[int] = []  # server: every applied gradient's staleness, in order
        self._reported = 0

    # --- shared pieces ---------------------------------------------------------------------------

    def _flat_grad(self) -> Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.params])

    def _encode(self, grad: Tensor) -> tuple[Tensor, CommStats]:
        payload = grad if self.identity else self.compressor.compress(grad)[0]
        return payload, CommStats(wire_bytes=payload.nbytes, raw_bytes=grad.nbytes)

    def _decode(self, payload: Tensor) -> Tensor:
        return payload if self.identity else self.compressor.decompress(payload, self.ctx)

    @torch.no_grad()
    def _load(self, flat: Tensor) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.copy_(flat[offset:offset + n].view_as(p))
            offset += n

    def _inbox(self) -> Tensor:
        """A buffer to receive one pushed gradient payload into."""
        return self.compressor.payload_like(self.ctx)

    def _header(self, kind: int) -> Tensor:
        return torch.tensor([kind], dtype=torch.int64, device=self.device)

    def _dst(self, r: int) -> dict:
        return {"group": self.group, "group_dst": r}

    def _src(self, r: int) -> dict:
        return {"group": self.group, "group_src": r}

    # --- the engine surface -------------------------------------------------------------------------

    def step(self) -> StepStats:
        t0 = time.perf_counter()
        grad = self._flat_grad()
        payload, comm = self._encode(grad)
        stats = StepStats(pack_s=time.perf_counter() - t0, applied=True, comm=comm)
        run = self._step_async if self.asynchronous else self._step_sync
        run(payload, stats)
        self.steps += 1
        self.last = stats
        return stats

    def flush(self) -> StepStats:
        """Sync: nothing is in flight. Async: a barrier; afterwards every rank holds the final weights."""
        stats = StepStats()
        if not self.asynchronous:
            return stats
        t0 = time.perf_counter()
        if self.server is None:
            req = dist.irecv(self._weights, **self._src(SERVER_RANK))
            dist.isend(self._header(_DONE), **self._dst(SERVER_RANK)).wait()
            req.wait()
            self._load(self._weights)
        else:
            self._join_server_thread()
            sends = [dist.isend(self.server.flat, **self._dst(r)) for r in range(1, self.world)]
            for req in sends:
                req.wait()
            self._load(self.server.flat)
        stats.wait_s = time.perf_counter() - t0
        return stats

    def summary(self) -> dict:
        """Run-level fields for summary.json (rank 0, async: staleness of every applied gradient)."""
        if not (self.asynchronous and self.server is not None):
            return {}
        s = self._staleness
        hist = torch.bincount(torch.tensor(s, dtype=torch.int64, device="cpu")).tolist() if s else []
        return {"staleness_mean": sum(s) / len(s) if s else None, "staleness_max": max(s, default=None),
                "staleness_histogram": hist, "server_updates": len(s)}

    def state_dict(self) -> dict:
        state = {"width": self.width, "steps": self.steps, "pending": []}
        if self.server is not None:
            with self.server.lock:
                state["server"] = {"weights": self.server.flat.clone(), "version": self.server.version,
                                   "optimizer": self.server.optimizer.state_dict()}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        if self.server is not None:
            if "server" not in state:
                raise ValueError("checkpoint has no parameter-server state (was it saved on rank 0?)")
            srv = state["server"]
            if srv["weights"].numel() != self.numel:
                raise ValueError(f"server weights have {srv['weights'].numel()} values, model has {self.numel}")
            self.server.flat.copy_(srv["weights"])
            self.server.version = int(srv["version"])
            self.server.optimizer.load_state_dict(srv["optimizer"])
            self._load(self.server.flat)

    def close(self) -> None:
        """Nothing to release in sync mode; an async server thread still serving (no ``flush()``,
        e.g. after an error) is a daemon and ends with the process."""
        if self._thread is not None and self._thread.is_alive():
            log.warning("parameter server closed without flush(); its thread is abandoned")

    # --- synchronous ---------------------------------------------------------------------------

    def _step_sync(self, payload: Tensor, stats: StepStats) -> None:
        t0 = time.perf_counter()
        mark = None if self._clock is None else self._clock.start()
        if self.server is None:
            # the pull's receive is posted before the push (one batch on NCCL)
            (req,), (push,) = post([(self._weights, SERVER_RANK)], [(payload, SERVER_RANK)], self.group, self._batch)
            push.wait()
            req.wait()
            t1 = time.perf_counter()
            self._time_round(mark, stats)
            self._load(self._weights)
        else:
            inboxes = [self._inbox() for _ in range(1, self.world)]
            reqs, _ = post(list(zip(inboxes, range(1, self.world))), [], self.group, self._batch)
            total = self._decode(payload).clone()
            for req, box in zip(reqs, inboxes):  # rank order: the same sum on every run
                req.wait()
                total.add_(self._decode(box))
            t1 = time.perf_counter()
            self._time_round(mark, stats)
            total.div_(self.world)
            self.server.apply(total)
            _, sends = post([], [(self.server.flat, r) for r in range(1, self.world)], self.group, self._batch)
            self._load(self.server.flat)
            for req in sends:
                req.wait()
        stats.wait_s = t1 - t0
        stats.update_s = time.perf_counter() - t1
        stats.comm.seconds = stats.wait_s

    def _time_round(self, mark, stats: StepStats) -> None:
        """On a GPU: the round's device time, from before its messages to after their arrival on
        this stream, is both its communication and its exposed time (the same spans PipeSGD
        reports, read lazily); on the host the wall clock around it is."""
        if mark is not None:
            span = self._clock.stop(mark)
            stats.comm.spans += (span,)
            stats.wait_spans += (span,)

    # --- asynchronous --------------------------------------------------------------------------

    def _step_async(self, payload: Tensor, stats: StepStats) -> None:
        t0 = time.perf_counter()
        if self.server is None:
            req = dist.irecv(self._weights, **self._src(SERVER_RANK))
            dist.isend(self._header(_PUSH), **self._dst(SERVER_RANK)).wait()
            dist.isend(payload, **self._dst(SERVER_RANK)).wait()
            req.wait()
            t1 = time.perf_counter()
            self._load(self._weights)
            stats.wait_s, stats.update_s = t1 - t0, time.perf_counter() - t1
            stats.comm.seconds = stats.wait_s
            return
        self._start_server_thread()
        grad = self._decode(payload).div(self.world)
        srv = self.server
        with srv.lock:
            t1 = time.perf_counter()
            self._staleness.append(srv.version - self._own_version)
            srv.apply(grad)
            self._load(srv.flat)
            self._own_version = srv.version
        stats.wait_s, stats.update_s = t1 - t0, time.perf_counter() - t1
        new = self._staleness[self._reported:]
        self._reported = len(self._staleness)
        stats.metrics = {"ps/staleness_mean": sum(new) / len(new), "ps/staleness_max": max(new),
                         "ps/server_version": srv.version}

    def _start_server_thread(self) -> None:
        if self._thread_error is not None:
            raise RuntimeError("the parameter-server thread failed") from self._thread_error
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="pipesgd-ps-server", daemon=True)
            self._thread.start()

    def _join_server_thread(self) -> None:
        self._start_server_thread()  # a flush before any step still waits for the workers' done
        self._thread.join()
        self._thread = None
        if self._thread_error is not None:
            raise RuntimeError("the parameter-server thread failed") from self._thread_error

    def _serve(self) -> None:
        """Receive-apply-reply, one request at a time, until every remote worker said done."""
        srv = self.server
        sent_version = dict.fromkeys(range(1, self.world), srv.version)
        done = 0
        header = self._header(_PUSH)
        inbox = self._inbox()
        try:
            while done < self.world - 1:
                src = dist.recv(header, group=self.group)  # any source; returns the global rank
                src = src if self.group is None else dist.get_group_rank(self.group, src)
                if int(header.item()) == _DONE:
                    done += 1
                    continue
                dist.recv(inbox, **self._src(src))
                grad = self._decode(inbox).div(self.world)
                with srv.lock:
                    self._staleness.append(srv.version - sent_version[src])
                    srv.apply(grad)
                    reply = srv.flat.clone()  # the lock is not held while bytes move
                    sent_version[src] = srv.version
                dist.isend(reply, **self._dst(src)).wait()
        except BaseException as e:  # surfaced on the main thread at its next step/flush
            self._thread_error = e
            log.error("parameter-server thread failed: %s", e)


@register("ps_sync", server=True, nonfinite_skip=False, min_world=2, elastic=False)
def build_sync(a: ModeArgs) -> tuple[nn.Module, ParameterServerEngine]:
    return a.model, ParameterServerEngine(a.optimizer, a.compressor, a.group, asynchronous=False)


@register("ps_async", overlap="async", server=True, nonfinite_skip=False, min_world=2, replicas_agree=False,
          elastic=False, nccl=False)
def build_async(a: ModeArgs) -> tuple[nn.Module, ParameterServerEngine]:
    return a.model, ParameterServerEngine(a.optimizer, a.compressor, a.group, asynchronous=True)
