"""PipeSGD, the width-K engine: WHEN a reduction is waited for and applied (``trainer.mode=sync``
and ``pipe``, built in :mod:`pipesgd.engine.sync_pipe`). docs/architecture.md, "The pipeline",
draws the schedule."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager

import torch
from torch import Tensor

from ..observability import trace
from ..comm import CommError, CommStats, CommThread, CompletedHandle, Handle, get_allreduce
from ..compress import Compressor
from ..flat import set_grads, state_to_device
from ..inflight import InFlight
from .exchange import GradientExchange, Reduced
from .parity import BufferBroadcast, broadcast_from_first_rank, clip_applied_gradient, listed, param_names
from ..reduction import Reduction
from .replicas import ReplicaMismatch, describe_mismatch, digest
from ..staleness import Staleness, make_staleness
from .base import Engine, NonFinitePolicy, ReductionError, StepStats, T


class PipeSGD(Engine):
    """Pipelined data-parallel SGD for any ``torch.optim`` optimizer.

    Call ``step()`` after each ``loss.backward()`` (instead of ``optimizer.step()``) and ``flush()``
    once at the end. The update applied at step t is ``optimizer.step()`` with every ``p.grad`` set
    to the rank-average of the gradients computed at step t-K+1; steps t < K-1 apply nothing;
    ``flush()`` applies what is still in flight, in order. Every replica applies the same averaged
    gradients in the same order, so replicas stay identical. With ``warmup_sync_steps = N``, steps
    t < N apply their own step's average (width 1) and the rule above holds from step N on, counting
    steps N..N+K-2 as the pipeline's fill. ``staleness`` replaces "optimizer.step() with the
    average" by a compensated update (docs/convergence.md); ``"none"`` is the rule above bit for bit.
    ``compressor`` is a per-chunk compressor carried inside ``allreduce``, or a reduction with
    collectives of its own (``"topk"``, ``"powersgd"``). ``allreduce="auto"`` runs NCCL's own
    all-reduce for compressor none, fp16 or bf16 on NCCL and the ring otherwise, picked when the
    exchange binds it (:mod:`pipesgd.comm.auto`; docs/gpu.md).

    Communication runs on a background thread over ``group`` (default: the default group). Run
    your own collectives (a metric all-reduce after an epoch, evaluation counts) through
    :meth:`collective`: on that thread, after the reductions in flight, so every rank issues them
    in one order with the engine's. Called from the training thread while an update is in flight,
    they work on Gloo but drive NCCL's communicators from two threads, which can deadlock.

    ``nonfinite``: when any rank's gradient of a step holds a NaN/inf, every rank either raises
    :class:`NonFiniteGradient` (``"abort"``) or skips that update (``"skip"``; ``StepStats.skipped``).
    While the engine owns ``optimizer``, calling ``optimizer.step()`` directly (as
    ``GradScaler.step(optimizer)`` does) raises: it would bypass the average. With a GradScaler:
    ``scaler.scale(loss).backward(); scaler.unscale_(optimizer); engine.step(); scaler.update()``.
    At construction every rank takes the first rank's ``params`` (and ``module``'s buffers, such as
    BatchNorm statistics, when ``module`` is given), as DDP does, so replicas start identical
    whatever each process seeded.
    ``max_grad_norm``: clip the total 2-norm of the gradient the optimizer applies, i.e. of the
    rank-average (DDP users clip after ``backward()``, where DDP has already averaged; clipping
    before ``step()`` here would clip this rank's own gradient). It runs as an optimizer step
    pre-hook, so lookahead's local steps are clipped alike.
    ``broadcast_buffers`` (with ``module``): at every step every rank takes the first rank's
    buffers, so each forward starts from them (DDP's default, which broadcasts before each forward),
    on the communication thread and ``group``, before the step's reduction; ``step()`` waits for it
    (so for the reductions queued before it: at width K > 2 one more is exposed). False leaves
    each rank's buffers its own.
    ``pseudo_gradients``: the parameters are an anchor and their gradients a round's pseudo-gradient
    (:class:`~pipesgd.engine.diloco.PipeDiLoCo`'s pipe): rules for the outer step (``eager``) apply,
    rules for per-step gradients do not. ``comm_thread``: a communication thread shared with other
    engines over the same group, closed by its owner (default: the engine's own).
    ``find_unused_parameters``: False (as DDP), a parameter in ``params`` without a ``.grad`` at
    ``step()`` raises, naming it; True (as DDP's), a parameter without a gradient on every rank is
    left alone by that update, as plain torch does (no momentum, no weight decay), and ranks that
    disagree about which parameters have one get :class:`ReductionError` naming them. It costs one
    small all-reduce per step, on the communication thread. Use the same setting on every rank.
    ``join()``: uneven inputs (DDP's ``Join``), see there.
    ``timeout_s``: a reduction not finished this long after ``step()`` starts waiting for it raises
    :class:`ReductionError`. Keep it below the process group's timeout: NCCL's watchdog counts from
    the enqueue, K-1 steps earlier, and ends the process at the group's timeout (the trainer uses
    80 % of ``dist.timeout_s``). The communication thread never keeps the process alive once the
    engine has raised.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Iterable[Tensor], width: int = 2,
                 compressor: str | Compressor | Reduction | None = "none",
                 allreduce: str | Callable[..., CommStats] = "auto", group=None,
                 warmup_sync_steps: int = 0, staleness: str | Staleness = "none", nonfinite: str = "abort",
                 timeout_s: float | None = None, max_grad_norm: float | None = None,
                 module: torch.nn.Module | None = None, broadcast_buffers: bool = True,
                 find_unused_parameters: bool = False, pseudo_gradients: bool = False,
                 comm_thread: CommThread | None = None, delay: int = 0, clock: Callable[[], int] | None = None):
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be an integer >= 1 (1 = synchronous), got {width!r}")
        if isinstance(warmup_sync_steps, bool) or not isinstance(warmup_sync_steps, int) or warmup_sync_steps < 0:
            raise ValueError(f"warmup_sync_steps must be an integer >= 0, got {warmup_sync_steps!r}")
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a number > 0 (or None: no clipping), got {max_grad_norm!r}")
        self.optimizer = optimizer
        self.width = width
        self.warmup_sync_steps = warmup_sync_steps
        fn = get_allreduce(allreduce) if isinstance(allreduce, str) else allreduce
        params = list(params)
        self._reducer = GradientExchange(params, compressor, fn, group, thread=comm_thread)
        broadcast_from_first_rank([*params, *(module.buffers() if module is not None else ())], group)
        self._names = param_names(self._reducer.params, module)
        self.find_unused_parameters = bool(find_unused_parameters)
        self._buffers = BufferBroadcast(module, self._reducer) if module is not None and broadcast_buffers else None
        self.compressor = self._reducer.compressor
        self.staleness = make_staleness(staleness)
        period = self.staleness.sync_period
        if period == ("step" if pseudo_gradients else "round"):
            raise ValueError(f"staleness={self.staleness.name} applies only "
                             f"{'per-step gradients' if period == 'step' else 'the outer step of rounds'}; "
                             f"{'use staleness=none or eager' if period == 'step' else 'run it with sync_every > 1 (PipeDiLoCo)'}")
        self.staleness.bind(self._reducer.params, optimizer)
        self._guard = optimizer.register_step_pre_hook(_guard(self.staleness))
        self._clip = None if max_grad_norm is None else clip_applied_gradient(
            optimizer, float(max_grad_norm), self._reducer.params)
        # WHEN: launched reductions until they are due (pipesgd.inflight, every engine's schedule)
        self.schedule: InFlight[Handle[Reduced]] = InFlight(width, delay, owner="a PipeSGD engine")
        self._clock = clock or (lambda: self.steps + 1)  # the tick a launch is at: this step, 1-based
        self.nonfinite = NonFinitePolicy(nonfinite)
        self.timeout_s = timeout_s
        self.steps = 0
        self.last = StepStats()
        self._forward_seen = False  # forward_context() entered since the last step
        self._warned_forward = False
        self._joining = False  # inside join(): every step carries the active count
        self.shadowed = 0  # steps this rank shadowed in its last join()
        self._resume = _ResumeCheck(optimizer)

    @property
    def in_flight(self) -> int:
        return len(self.schedule)

    @property
    def world_size(self) -> int:
        """Ranks of the engine's group (1 without a process group)."""
        return self._reducer.world_size

    def step(self) -> StepStats:
        """Launch this step's reduction; apply the one from K-1 steps ago if there is one."""
        self._check_forward_context()
        self._resume.check(self)
        missing = [i for i, p in enumerate(self._reducer.params) if p.grad is None]
        if missing and not self.find_unused_parameters:
            raise RuntimeError(
                f"{listed(self._names, missing)} got no gradient on this rank before engine.step() (unused in "
                "forward, or frozen): pass find_unused_parameters=True to leave such parameters untouched, as "
                "plain torch does, or leave them out of params")
        control = self._control(active=True, missing=missing)
        return self._launch(self._reducer.flatten(), control=control)

    def _control(self, active: bool, missing: list[int] = ()) -> Tensor | None:
        """This rank's control vector, or None when no one needs one: [1 if still training], then
        with find_unused_parameters one 1 per parameter that has a gradient. Summed, the first
        entry counts the ranks still training; a parameter's entry is 0 (nobody has a gradient: not
        updated) or that count (everyone has), anything else is a disagreement."""
        if not (self._joining or self.find_unused_parameters):
            return None
        n = len(self._reducer.params) if self.find_unused_parameters else 0
        control = torch.zeros(1 + n, dtype=torch.int64, device=self._reducer.params[0].device)
        if active:
            control[:] = 1
            if missing:
                control[1 + torch.tensor(missing, device=control.device)] = 0
        return control

    def _launch(self, buf: Tensor, control: Tensor | None = None, reduced_control: Tensor | None = None) -> StepStats:
        t0 = time.perf_counter()
        buffers = None
        with trace.current().span("pack", "pack", self.steps):
            self.staleness.launched(buf[:-1])
            if self._buffers is not None:
                # One order on every rank, a joined one's too: control round, buffers, reduction.
                if control is not None:
                    self._reducer.control_round(control)  # summed in place, first on the thread
                    control, reduced_control = None, control
                buffers = self._buffers.start()
            self.schedule.launch(self._reducer.launch(buf, control, reduced_control), self._clock())
        if buffers is not None:
            self._buffers.land(self._wait(buffers, self.steps + 1, self.steps + 1,
                                          f"the broadcast of the module's buffers at step {self.steps + 1}"))
        stats = StepStats(pack_s=time.perf_counter() - t0)
        if self.schedule.due(self._clock(), width=1 if self.steps < self.warmup_sync_steps else None):
            self._apply_oldest(stats, self.steps + 1)
        self.steps += 1
        self.last = stats
        return stats

    @contextlib.contextmanager
    def join(self) -> Iterator[PipeSGD]:
        """Uneven inputs (DDP's ``Join``): run the training loop inside ``with engine.join():`` on
        every rank. A rank that leaves the block (out of batches) shadows the others' steps with a
        zero gradient until every rank has left; then all have launched the same reductions and
        ``flush()`` applies the rest alike. The average still divides by the whole group, as DDP's
        ``divide_by_initial_world_size=True``. Each step inside costs one small all-reduce more. An
        exception inside the block propagates without shadowing (the others then time out)."""
        if self._joining:
            raise RuntimeError("engine.join() is already active; it does not nest")
        self._joining = True
        try:
            yield self
        except BaseException:
            self._joining = False
            raise
        try:
            self.shadowed = 0
            while True:
                control = self._control(active=False)
                handle = self._reducer.control_round(control)
                total = self._wait(handle, self.steps + 1, self.steps + 1, "the join round")
                if int(total[0]) == 0:  # nobody trains any more
                    break
                self._launch(self._reducer.zeros(), reduced_control=total)
                self.shadowed += 1
        finally:
            self._joining = False

    def flush(self) -> StepStats:
        """Wait for and apply every outstanding reduction, oldest first."""
        stats = StepStats()
        while self.schedule:
            self._apply_oldest(stats, self.steps)
        return stats

    def _apply_oldest(self, stats: StepStats, current: int) -> None:
        """Wait for the oldest reduction and apply it; ``current`` is the (1-based) step the caller is in."""
        step = current - len(self.schedule) + 1  # the step whose gradient this is
        tr = trace.current()
        t0 = time.perf_counter()
        _, handle = self.schedule.pop()
        with tr.span("wait", "wait", self.steps):
            reduced = self._wait(handle, step, current)
        t1 = time.perf_counter()
        stats.wait_s += t1 - t0
        stats.comm += reduced.stats
        comm_span, stall = handle.spans  # device times (GPU), read later
        if comm_span is not None:
            stats.comm.spans += (comm_span,)
        if stall is not None:
            stats.wait_spans += (stall,)
        if reduced.nonfinite:
            flags = self._reducer.gather(int(reduced.local_nonfinite))
            ranks = [str(r) for r, bad in enumerate(flags) if bad]
            where = (f"NaN/inf on rank(s) {', '.join(ranks)}" if ranks else
                     "no rank reports NaN/inf of its own: the sum overflowed, or it was restored from a checkpoint")
            self.nonfinite.bad(step, where)
            self.staleness.skip()
            # As an applied update does: the gradients view the buffer handed back, so a loop that
            # zeroes them in place keeps reusing it (never the one just launched; _let_go).
            set_grads(self._reducer.params, reduced.flat)
            self._reducer.release(reduced.flat)
            stats.skipped = True
            return
        self.nonfinite.good()
        self.staleness.without_grad = self._without_grad(reduced.control, step)
        with tr.span("update", "update", self.steps):
            self.staleness.apply(reduced.flat)
        self._reducer.release(reduced.flat)  # reused once the gradients no longer view it
        stats.staleness = len(self.schedule)
        stats.update_s += time.perf_counter() - t1
        stats.applied = True

    def _without_grad(self, control: Tensor | None, step: int) -> tuple[int, ...]:
        """The parameters no rank had a gradient for at ``step`` (find_unused_parameters)."""
        if control is None or not self.find_unused_parameters:
            return ()
        counts = control.tolist()
        active, present = counts[0], counts[1:]
        odd = [i for i, c in enumerate(present) if 0 < c < active]
        if odd:
            raise ReductionError(
                f"ranks disagree about which parameters have a gradient at step {step}: {listed(self._names, odd)} "
                f"had one on only some of the {active} rank(s) training; every rank must leave the same "
                "parameters unused (find_unused_parameters=True)", None)
        return tuple(i for i, c in enumerate(present) if c == 0)

    def _wait(self, handle: Handle, step: int, current: int, what: str | None = None):
        what = what or f"the reduction of step {step}'s gradient (waited for at step {current})"
        try:
            return handle.wait(self.timeout_s)
        except TimeoutError as e:
            activity = self._reducer.activity
            where = (f"the communication thread was {activity}" if activity else
                     str(e) or "the communication thread was idle")  # on a GPU: its device work hangs
            raise ReductionError(f"{what} did not finish within {self.timeout_s:g} s; {where}", activity) from None
        except CommError as e:
            raise ReductionError(f"{what} failed: {e}", e.activity) from e

    def forward_context(self) -> AbstractContextManager:
        """Run the next forward and backward inside this: the weights the staleness strategy wants
        the gradient at (``predict`` extrapolates; the others leave the weights alone)."""
        self._forward_seen = True
        return self.staleness.forward_context(self.in_flight)

    def _check_forward_context(self) -> None:
        """Lookahead or predict without ``forward_context()`` is silently the plain rule: say so once."""
        if (self.staleness.uses_forward_context and self.in_flight and not self._forward_seen
                and not self._warned_forward):
            self._warned_forward = True
            warnings.warn(
                f"staleness={self.staleness.name!r} acts only inside `with engine.forward_context():` around "
                "the forward and backward pass; this step ran without it, so the update is the plain "
                "stale rule", RuntimeWarning, stacklevel=3)
        self._forward_seen = False

    def consistent_params(self) -> Tensor:
        """A flat copy of the weights every replica holds identically (``dga`` replicas differ by
        their pending local steps; this is the weights without them)."""
        return self.staleness.consistent_params()

    def consistent_weights(self) -> AbstractContextManager:
        """Inside: the parameters hold :meth:`consistent_params` (evaluate here); restored after."""
        return self.staleness.consistent_weights()

    def state_dict(self) -> dict:
        """Engine state including in-flight gradients (waited for, not applied) with their
        non-finite flags, the staleness strategy's and the reduction's state (error-feedback
        residuals), so a restored engine applies exactly what this one would have. Does not
        include the optimizer. ``pending`` is identical on every rank; ``staleness`` and
        ``reduction`` may be per rank. Waiting here exposes at most one reduction time."""
        first = self.steps - len(self.schedule) + 1
        settled = self.schedule.settle(lambda at, h: CompletedHandle(self._wait(h, first, self.steps)))
        done = [h.wait() for h in settled]
        return {"width": self.width, "steps": self.steps, "pending": [r.flat.clone() for r in done],
                "pending_at": [at for at, _ in self.schedule],
                "pending_nonfinite": [r.nonfinite for r in done], "nonfinite": self.nonfinite.state_dict(),
                "staleness": self.staleness.state_dict(), "reduction": self._reducer.state_dict()}

    shared_state = ("pending", "pending_nonfinite")

    def state_for_new_rank(self, state: dict) -> dict:
        """Without what the reduction declares only its own rank may keep (an error-feedback
        residual: gradient mass that rank owes the average)."""
        drop = self._reducer.reduction.elastic_drop
        return {**state, "reduction": {k: v for k, v in state.get("reduction", {}).items() if k not in drop}}

    def load_state_dict(self, state: dict) -> None:
        if state["width"] != self.width:
            raise ValueError(f"checkpoint has width={state['width']}, engine has width={self.width}")
        if self.schedule:
            raise RuntimeError("load_state_dict on an engine with reductions in flight; call flush() first")
        device = self._reducer.params[0].device
        state = state_to_device(state, device)  # a checkpoint is loaded to the CPU; the state lives with the params
        numel = self._reducer.numel
        for f in state["pending"]:
            if f.numel() != numel:
                raise ValueError(f"in-flight gradient has {f.numel()} values, model has {numel}")
        self.steps = int(state["steps"])
        self.staleness.load_state_dict(state.get("staleness", {}))
        self._reducer.load_state_dict(state.get("reduction", {}))
        flags = state.get("pending_nonfinite", [False] * len(state["pending"]))
        # launch ticks: saved since the schedule was shared; before, they were the steps in a row
        ticks = state.get("pending_at") or [self.steps - len(state["pending"]) + 1 + i
                                            for i in range(len(state["pending"]))]
        self.schedule.restore(
            (at, CompletedHandle(Reduced(f.clone(), CommStats(),
                                         torch.tensor([float("inf") if bad else 0.0], device=device))))
            for at, f, bad in zip(ticks, state["pending"], flags))
        if "nonfinite" in state:
            self.nonfinite.load_state_dict(state["nonfinite"])
        self._resume.engine_loaded = True

    def collective(self, fn: Callable[[], T], what: str = "a collective") -> T:
        """Run ``fn`` on the communication thread, after the reductions in flight (no flush), and
        return its result: the caller's collectives (on any group) then keep one order with the
        engine's on every rank, as NCCL requires. Errors come back as
        :class:`~pipesgd.comm.CommError` naming ``what``."""
        return self._reducer.run(fn, what, self.timeout_s)

    def check_replicas(self) -> None:
        """Raise :class:`~pipesgd.reliability.replicas.ReplicaMismatch` on every rank if the replicas' weights
        (:meth:`consistent_params`) are not bit-identical. Collective on the engine's group: call it
        at the same step on every rank; it runs on the communication thread after the reductions
        in flight, so it needs no flush. One sha256 of the weights and a 32-byte all-gather."""
        mine = torch.tensor(list(bytes.fromhex(digest(self.consistent_params()))), dtype=torch.uint8,
                            device=self._reducer.params[0].device)
        out = self._reducer.gather_tensor(mine, self.timeout_s)
        problem = describe_mismatch([bytes(t.cpu().tolist()).hex() for t in out], self.steps)
        if problem:
            raise ReplicaMismatch(problem + " (engine.check_replicas(); every rank applies the same updates, so "
                                  "this is a rank that changed its weights outside engine.step(), a bug, or "
                                  "non-deterministic hardware)")

    def close(self) -> None:
        """Stop the communication thread (after ``flush()``; pending work is cancelled)."""
        if self._clip is not None:
            self._clip.remove()
            self._clip = None
        self._guard.remove()
        self._resume.close()
        self._reducer.close()


class _ResumeCheck:
    """Loading the optimizer's state without the engine's loses what was in flight (K-1 updates,
    the staleness rule's and the reduction's state): warn at the next step unless the engine's
    state was loaded too."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer_loaded = self.engine_loaded = False
        self._hook = optimizer.register_load_state_dict_post_hook(self._loaded)

    def _loaded(self, optimizer) -> None:
        self.optimizer_loaded = True

    def check(self, engine: PipeSGD) -> None:
        if not self.optimizer_loaded:
            return
        self.optimizer_loaded = False
        if self.engine_loaded or engine.steps or (engine.width == 1 and not engine.staleness.state_dict()
                                                  and not engine._reducer.state_dict()):
            return
        warnings.warn(
            "optimizer.load_state_dict() was called but engine.load_state_dict() was not: the checkpointed run's "
            f"{engine.width - 1} in-flight update(s) (and the staleness rule's and the reduction's state) are lost, "
            "so this run departs from the uninterrupted one; save engine.state_dict() beside the optimizer's and "
            "load it on resume", RuntimeWarning, stacklevel=3)

    def close(self) -> None:
        self._hook.remove()


def _guard(rule: Staleness) -> Callable:
    def check(optimizer, args, kwargs) -> None:
        if not rule.stepping:
            raise RuntimeError(
                "optimizer.step() was called directly on an optimizer a PipeSGD engine owns; it would apply "
                "this rank's own gradient, not the average: call engine.step() instead (with a GradScaler: "
                "scaler.unscale_(optimizer); engine.step(); scaler.update()), or engine.close() to release it")
    return check
