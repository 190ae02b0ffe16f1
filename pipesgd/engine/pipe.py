"""PipeSGD, the width-K engine: WHEN a reduction is waited for and applied (``trainer.mode=sync``
and ``pipe``). docs/architecture.md, "The pipeline", draws the schedule."""

from __future__ import annotations

import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import Tensor

from .. import trace
from ..comm import CommError, CommStats, CompletedHandle, Handle, get_allreduce
from ..compress import Compressor
from .exchange import GradientExchange, Reduced
from ..reduction import Reduction
from ..staleness import Staleness, make_staleness
from .base import Engine, ModeArgs, NonFinitePolicy, ReductionError, StepStats, to_device


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
    collectives of its own (``"topk"``, ``"powersgd"``).

    Communication runs on a background thread over ``group`` (default: the default group). Do not
    issue other collectives on the same group from another thread while reductions are in flight;
    give the engine its own group (``dist.new_group()``) if your loop needs collectives too.

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
    ``timeout_s``: a reduction not finished this long after ``step()`` starts waiting for it raises
    :class:`ReductionError` (a backstop: the backend's own timeout usually fires first).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Iterable[Tensor], width: int = 2,
                 compressor: str | Compressor | Reduction | None = "none",
                 allreduce: str | Callable[..., CommStats] = "ring", group=None,
                 warmup_sync_steps: int = 0, staleness: str | Staleness = "none", nonfinite: str = "abort",
                 timeout_s: float | None = None, max_grad_norm: float | None = None,
                 module: torch.nn.Module | None = None):
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
        self._reducer = GradientExchange(params, compressor, fn, group)
        _broadcast_from_first_rank([*params, *(module.buffers() if module is not None else ())], group)
        self.compressor = self._reducer.compressor
        self.staleness = make_staleness(staleness)
        self.staleness.bind(self._reducer.params, optimizer)
        self._guard = optimizer.register_step_pre_hook(_guard(self.staleness))
        self._clip = None if max_grad_norm is None else optimizer.register_step_pre_hook(
            _clipper(self._reducer.params, float(max_grad_norm)))
        self._pending: deque[Handle[Reduced]] = deque()
        self.nonfinite = NonFinitePolicy(nonfinite)
        self.timeout_s = timeout_s
        self.steps = 0
        self.last = StepStats()
        weakref.finalize(self, _warn_unapplied, self._pending)  # at collection or interpreter exit
        self._forward_seen = False  # forward_context() entered since the last step
        self._warned_forward = False

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def step(self) -> StepStats:
        """Launch this step's reduction; apply the one from K-1 steps ago if there is one."""
        self._check_forward_context()
        t0 = time.perf_counter()
        with trace.current().span("pack", "pack", self.steps):
            buf = self._reducer.flatten()  # the gradient, then the non-finite flag slot
            self.staleness.launched(buf[:-1])
            self._pending.append(self._reducer.launch(buf))
        stats = StepStats(pack_s=time.perf_counter() - t0)
        width = 1 if self.steps < self.warmup_sync_steps else self.width
        if len(self._pending) == width:
            self._apply_oldest(stats, self.steps + 1)
        self.steps += 1
        self.last = stats
        return stats

    def flush(self) -> StepStats:
        """Wait for and apply every outstanding reduction, oldest first."""
        stats = StepStats()
        while self._pending:
            self._apply_oldest(stats, self.steps)
        return stats

    def _apply_oldest(self, stats: StepStats, current: int) -> None:
        """Wait for the oldest reduction and apply it; ``current`` is the (1-based) step the caller is in."""
        step = current - len(self._pending) + 1  # the step whose gradient this is
        tr = trace.current()
        t0 = time.perf_counter()
        with tr.span("wait", "wait", self.steps):
            reduced = self._wait(self._pending.popleft(), step, current)
        t1 = time.perf_counter()
        stats.wait_s += t1 - t0
        stats.comm += reduced.stats
        if reduced.nonfinite:
            flags = self._reducer.gather(int(reduced.local_nonfinite))
            ranks = [str(r) for r, bad in enumerate(flags) if bad]
            where = (f"NaN/inf on rank(s) {', '.join(ranks)}" if ranks else
                     "no rank reports NaN/inf of its own: the sum overflowed, or it was restored from a checkpoint")
            self.nonfinite.bad(step, where)
            self.staleness.skip()
            stats.skipped = True
            return
        self.nonfinite.good()
        with tr.span("update", "update", self.steps):
            self.staleness.apply(reduced.flat)
        stats.staleness = len(self._pending)
        stats.update_s += time.perf_counter() - t1
        stats.applied = True

    def _wait(self, handle: Handle[Reduced], step: int, current: int) -> Reduced:
        what = f"the reduction of step {step}'s gradient (waited for at step {current})"
        try:
            return handle.wait(self.timeout_s)
        except TimeoutError:
            activity = self._reducer.activity
            raise ReductionError(f"{what} did not finish within {self.timeout_s:g} s; the communication "
                                 f"thread was {activity or 'idle'}", activity) from None
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
        done = [self._wait(h, self.steps - len(self._pending) + 1 + i, self.steps)
                for i, h in enumerate(self._pending)]
        self._replace_pending(CompletedHandle(r) for r in done)
        return {"width": self.width, "steps": self.steps, "pending": [r.flat.clone() for r in done],
                "pending_nonfinite": [r.nonfinite for r in done], "nonfinite": self.nonfinite.state_dict(),
                "staleness": self.staleness.state_dict(), "reduction": self._reducer.state_dict()}

    def _replace_pending(self, handles: Iterable[Handle[Reduced]]) -> None:
        """In place: the exit check (``_warn_unapplied``) holds this very deque."""
        handles = list(handles)
        self._pending.clear()
        self._pending.extend(handles)

    def load_state_dict(self, state: dict) -> None:
        if state["width"] != self.width:
            raise ValueError(f"checkpoint has width={state['width']}, engine has width={self.width}")
        if self._pending:
            raise RuntimeError("load_state_dict on an engine with reductions in flight; call flush() first")
        device = self._reducer.params[0].device
        state = to_device(state, device)  # a checkpoint is loaded to the CPU; the state lives with the params
        numel = self._reducer.numel
        for f in state["pending"]:
            if f.numel() != numel:
                raise ValueError(f"in-flight gradient has {f.numel()} values, model has {numel}")
        self.steps = int(state["steps"])
        self.staleness.load_state_dict(state.get("staleness", {}))
        self._reducer.load_state_dict(state.get("reduction", {}))
        flags = state.get("pending_nonfinite", [False] * len(state["pending"]))
        self._replace_pending(
            CompletedHandle(Reduced(f.clone(), CommStats(),
                                    torch.tensor([float("inf") if bad else 0.0], device=device)))
            for f, bad in zip(state["pending"], flags))
        if "nonfinite" in state:
            self.nonfinite.load_state_dict(state["nonfinite"])

    def close(self) -> None:
        """Stop the communication thread (after ``flush()``; pending work is cancelled)."""
        if self._clip is not None:
            self._clip.remove()
            self._clip = None
        self._guard.remove()
        self._reducer.close()


def build(a: ModeArgs) -> tuple[torch.nn.Module, PipeSGD]:
    return a.model, PipeSGD(a.optimizer, a.model.parameters(), width=a.width, compressor=a.compressor,
                            allreduce=a.allreduce, group=a.group, warmup_sync_steps=a.warmup_sync_steps,
                            staleness=a.staleness, nonfinite=a.nonfinite, timeout_s=a.timeout_s)


def _broadcast_from_first_rank(tensors: list[Tensor], group) -> None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.detach(), src=src, group=group)


def _guard(rule: Staleness) -> Callable:
    def check(optimizer, args, kwargs) -> None:
        if not rule.stepping:
            raise RuntimeError(
                "optimizer.step() was called directly on an optimizer a PipeSGD engine owns; it would apply "
                "this rank's own gradient, not the average: call engine.step() instead (with a GradScaler: "
                "scaler.unscale_(optimizer); engine.step(); scaler.update()), or engine.close() to release it")
    return check


def _clipper(params: list[Tensor], max_norm: float) -> Callable:
    def clip(optimizer, args, kwargs) -> None:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
    return clip


def _warn_unapplied(pending: deque) -> None:
    if pending:
        warnings.warn(f"a PipeSGD engine ended with {len(pending)} update(s) in flight that were never applied: "
                      "call engine.flush() after the last engine.step()", RuntimeWarning, stacklevel=2)
