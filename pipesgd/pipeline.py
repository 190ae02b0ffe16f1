"""The width-K engine: WHEN a reduction is waited for and applied.

Step t launches the reduction of the gradient just computed and then applies the one launched at
step t-K+1, so K-1 reductions are always in flight behind the caller's next forward/backward::

    t:        0      1      2      3     ...   flush()
    launch:   g0     g1     g2     g3
    apply:    -      g0     g1     g2           g3        (K = 2)

K = 1 launches and waits at once: plain synchronous allreduce SGD through the same code.
With ``warmup_sync_steps = N`` the first N steps run at width 1 before the pipeline fills (stale
gradients with momentum are unstable while the early loss surface is steep; BytePS does the same).

Faults surface here, where the update needs the reduced buffer: a NaN/inf gradient on any rank
(the reducer's flag, identical on every rank, so all ranks skip or all abort) and a reduction that
fails or outlives ``timeout_s`` (:class:`ReductionError`, naming the step and the peer waited on).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .comm import CommError, CommStats, CompletedHandle, Handle, get_allreduce
from .comm.native import check_native, native_allreduce
from .compress import Compressor, get_compressor
from .reducer import Reduced, Reducer

log = logging.getLogger(__name__)

NONFINITE = ("abort", "skip")


@dataclass
class StepStats:
    """Where the caller's time went inside one ``step()``; ``comm`` is the applied reduction's cost.
    ``skipped``: an update was due but dropped because its gradient was non-finite."""

    pack_s: float = 0.0
    wait_s: float = 0.0
    update_s: float = 0.0
    applied: bool = False
    comm: CommStats = field(default_factory=CommStats)
    skipped: bool = False


class ReductionError(CommError):
    """A reduction this rank waited for failed or did not finish within the engine's timeout."""


class NonFiniteGradient(FloatingPointError):
    """A step's averaged gradient is non-finite and the policy says stop (raised on every rank)."""


class NonFinitePolicy:
    """What every rank does with an update whose gradient is non-finite somewhere: ``abort``
    raises :class:`NonFiniteGradient`; ``skip`` drops the update, but raises after
    ``max_in_a_row`` consecutive skips (a run whose weights are already NaN only ever skips).
    Callers feed it the same decisions in the same order on every rank, so its state agrees."""

    def __init__(self, mode: str = "abort", max_in_a_row: int = 10):
        if mode not in NONFINITE:
            raise ValueError(f"nonfinite={mode!r} is not known; allowed: {', '.join(NONFINITE)}")
        self.mode, self.max_in_a_row = mode, max_in_a_row
        self.in_a_row = 0
        self.skipped: list[int] = []

    def bad(self, step: int, where: str) -> None:
        """Step ``step``'s gradient is non-finite (``where`` says on which ranks): log and skip, or raise."""
        what = f"non-finite gradient at step {step} ({where})"
        if self.mode == "abort":
            raise NonFiniteGradient(f"{what}; trainer.nonfinite=abort stops every rank (set "
                                    "trainer.nonfinite=skip to drop such steps, or lower the learning rate)")
        self.in_a_row += 1
        if self.in_a_row > self.max_in_a_row:
            raise NonFiniteGradient(f"{what}: the {self.in_a_row}th such step in a row; stopping because "
                                    "skipping no longer helps (are the weights already non-finite?)")
        self.skipped.append(step)
        log.warning("%s: update skipped on every rank (trainer.nonfinite=skip)", what)

    def good(self) -> None:
        self.in_a_row = 0

    def state_dict(self) -> dict:
        return {"in_a_row": self.in_a_row, "skipped": list(self.skipped)}

    def load_state_dict(self, state: dict) -> None:
        self.in_a_row, self.skipped = int(state["in_a_row"]), [int(s) for s in state["skipped"]]


class PipeSGD:
    """Pipelined data-parallel SGD for any ``torch.optim`` optimizer.

    Call ``step()`` after each ``loss.backward()`` (instead of ``optimizer.step()``) and ``flush()``
    once at the end. The update applied at step t is ``optimizer.step()`` with every ``p.grad`` set
    to the rank-average of the gradients computed at step t-K+1; steps t < K-1 apply nothing;
    ``flush()`` applies what is still in flight, in order. Every replica applies the same averaged
    gradients in the same order, so replicas stay identical. With ``warmup_sync_steps = N``, steps
    t < N apply their own step's average (width 1) and the rule above holds from step N on, counting
    steps N..N+K-2 as the pipeline's fill.

    Communication runs on a background thread over ``group`` (default: the default group). Do not
    issue other collectives on the same group from another thread while reductions are in flight;
    give the engine its own group (``dist.new_group()``) if your loop needs collectives too.

    ``nonfinite``: when any rank's gradient of a step holds a NaN/inf, every rank either raises
    :class:`NonFiniteGradient` (``"abort"``) or skips that update (``"skip"``; ``StepStats.skipped``).
    ``timeout_s``: a reduction not finished this long after ``step()`` starts waiting for it raises
    :class:`ReductionError` (a backstop: the backend's own timeout usually fires first).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Iterable[Tensor], width: int = 2,
                 compressor: str | Compressor | None = "none",
                 allreduce: str | Callable[..., CommStats] = "ring", group=None,
                 warmup_sync_steps: int = 0, nonfinite: str = "abort", timeout_s: float | None = None):
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be an integer >= 1 (1 = synchronous), got {width!r}")
        if isinstance(warmup_sync_steps, bool) or not isinstance(warmup_sync_steps, int) or warmup_sync_steps < 0:
            raise ValueError(f"warmup_sync_steps must be an integer >= 0, got {warmup_sync_steps!r}")
        self.optimizer = optimizer
        self.width = width
        self.warmup_sync_steps = warmup_sync_steps
        self.compressor = get_compressor(compressor)
        fn = get_allreduce(allreduce) if isinstance(allreduce, str) else allreduce
        if fn is native_allreduce:
            check_native(self.compressor)
        self.allreduce_name = allreduce if isinstance(allreduce, str) else getattr(fn, "__name__", "custom")
        self._reducer = Reducer(params, self.compressor, fn, group)
        self._pending: deque[Handle[Reduced]] = deque()
        self.nonfinite = NonFinitePolicy(nonfinite)
        self.timeout_s = timeout_s
        self.steps = 0
        self.last = StepStats()

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def step(self) -> StepStats:
        """Launch this step's reduction; apply the one from K-1 steps ago if there is one."""
        t0 = time.perf_counter()
        width = 1 if self.steps < self.warmup_sync_steps else self.width
        self._pending.append(self._reducer.launch())
        self.steps += 1
        stats = StepStats(pack_s=time.perf_counter() - t0)
        if len(self._pending) == width:
            self._apply_oldest(stats)
        self.last = stats
        return stats

    def flush(self) -> StepStats:
        """Wait for and apply every outstanding reduction, oldest first."""
        stats = StepStats()
        while self._pending:
            self._apply_oldest(stats)
        return stats

    def _apply_oldest(self, stats: StepStats) -> None:
        step = self.steps - len(self._pending) + 1  # the (1-based) step whose gradient this is
        t0 = time.perf_counter()
        reduced = self._wait(self._pending.popleft(), step)
        t1 = time.perf_counter()
        stats.wait_s += t1 - t0
        stats.comm += reduced.stats
        if reduced.nonfinite:
            flags = self._reducer.gather(int(reduced.local_nonfinite))
            ranks = [str(r) for r, bad in enumerate(flags) if bad]
            where = (f"NaN/inf on rank(s) {', '.join(ranks)}" if ranks else
                     "no rank reports NaN/inf of its own: the sum overflowed, or it was restored from a checkpoint")
            self.nonfinite.bad(step, where)
            stats.skipped = True
            return
        self.nonfinite.good()
        self._reducer.unflatten(reduced.flat)
        self.optimizer.step()
        stats.update_s += time.perf_counter() - t1
        stats.applied = True

    def _wait(self, handle: Handle[Reduced], step: int) -> Reduced:
        what = f"the reduction of step {step}'s gradient (waited for at step {self.steps})"
        try:
            return handle.wait(self.timeout_s)
        except TimeoutError:
            activity = self._reducer.activity
            raise ReductionError(f"{what} did not finish within {self.timeout_s:g} s; the communication "
                                 f"thread was {activity or 'idle'}", activity) from None
        except CommError as e:
            raise ReductionError(f"{what} failed: {e}", e.activity) from e

    def state_dict(self) -> dict:
        """Engine state including in-flight gradients (waited for, not applied), so a restored
        engine applies exactly what this one would have. Does not include the optimizer.

        ``pending`` holds the reduced flat buffers, oldest first: the averaged gradient in
        parameter order, then the non-finite flag. Waiting for them here exposes at most one
        reduction's time once per checkpoint; the values are identical on every rank."""
        done = [self._wait(h, self.steps - len(self._pending) + 1 + i) for i, h in enumerate(self._pending)]
        self._pending = deque(CompletedHandle(Reduced(r.flat, CommStats(), r.local_nonfinite)) for r in done)
        return {"width": self.width, "steps": self.steps, "pending": [r.flat.clone() for r in done],
                "nonfinite": self.nonfinite.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["width"] != self.width:
            raise ValueError(f"checkpoint has width={state['width']}, engine has width={self.width}")
        if self._pending:
            raise RuntimeError("load_state_dict on an engine with reductions in flight; call flush() first")
        numel = self._reducer.flat_numel
        for f in state["pending"]:
            if f.numel() != numel:
                raise ValueError(f"in-flight gradient buffer has {f.numel()} values, this model needs {numel} "
                                 "(gradients + the non-finite flag)")
        self.steps = int(state["steps"])
        self._pending = deque(CompletedHandle(Reduced(f.clone(), CommStats())) for f in state["pending"])
        if "nonfinite" in state:
            self.nonfinite.load_state_dict(state["nonfinite"])

    def close(self) -> None:
        """Stop the communication thread (after ``flush()``; pending work is cancelled)."""
        self._reducer.close()

    def __enter__(self) -> PipeSGD:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
