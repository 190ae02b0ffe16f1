"""``staleness=lookahead``: the gradient at the weights the optimizer reaches once the in-flight
steps land, this rank's own gradients standing in for their averages."""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from torch import Tensor

from ..flat import assign_params, flat_params, has_nonfinite
from .base import Staleness, register


@register("lookahead")
class LocalLookahead(Staleness):
    """Forward/backward at ``ŵ = S(…S(w, g_{t-D}^local)…, g_{t-1}^local)``: the optimizer's own step
    ``S`` (momentum, weight decay, lr, LARS trust ratio: whatever ``optimizer.step()`` does) taken
    on each in-flight gradient in launch order, with this rank's gradient standing in for the
    average that has not arrived. The weights and the optimizer state are restored exactly on
    exit and the averages are applied as in ``none``, so replicas stay bit-identical.

    The true weights that the gradient will be applied to are ``S(…S(w, ḡ_{t-D})…, ḡ_{t-1})``, so
    ``ŵ`` misses them only by the steps' local-minus-average noise; with one rank (or identical
    data on every rank) ``ŵ`` is them, and the width-K run is synchronous SGD shifted by K-1
    steps, bit for bit. This is where it differs from ``predict``, which extrapolates the last
    applied update (one step older) and from ``dga``, whose local step has no momentum: at
    momentum μ the next update is mostly ``μ·v``, which both of those miss.

    Cost: per launch one gradient copy; per forward D optimizer steps, one weight snapshot and a
    copy of the optimizer's state for these parameters, restored on exit. Memory: D gradients,
    one weight copy and one optimizer-state copy. Optimizer step hooks run on the lookahead steps
    too. A non-finite local gradient contributes no lookahead step. The kept gradients are handed
    to ``optimizer.step()`` as they are (torch's optimizers and LARS only read ``p.grad``); an
    optimizer that writes into its gradient would only skew later lookaheads at K >= 3, never
    the applied update.
    """

    uses_forward_context = True

    def __init__(self) -> None:
        self._local: deque[Tensor] = deque()

    def launched(self, local: Tensor) -> None:
        # NaN/inf here would poison the next forward; the update itself is the policy's business.
        self._local.append(local.clone().masked_fill_(has_nonfinite(local), 0.0))

    def skip(self) -> None:
        self._local.popleft()

    def apply(self, avg: Tensor) -> None:
        self._local.popleft()
        self.step_optimizer(avg)

    def forward_context(self, delay: int) -> AbstractContextManager:
        if delay == 0 or not self._local:
            return nullcontext()
        return self._ahead()

    @contextmanager
    def _ahead(self) -> Iterator[None]:
        weights = flat_params(self.params)
        state = self.optimizer.state
        saved = {p: _copy_state(state[p]) if p in state else None for p in self.params}
        grads = [p.grad for p in self.params]
        try:
            for local in self._local:
                self.step_optimizer(local)
        finally:
            for p, g in zip(self.params, grads):
                p.grad = g
        try:
            yield
        finally:
            assign_params(self.params, weights)
            for p, s in saved.items():
                if s is None:
                    state.pop(p, None)
                else:
                    state[p] = s

    def state_dict(self) -> dict:
        return {"local": [g.clone() for g in self._local]}

    def load_state_dict(self, state: dict) -> None:
        self._local = deque(self._check_numel("local gradient", g) for g in state.get("local", []))


def _copy_state(state: dict) -> dict:
    """A copy of one parameter's optimizer state: tensors cloned (7x cheaper than deepcopy on
    ResNet-20's 65 parameters: 0.19 against 1.37 ms), anything else deep-copied."""
    return {k: v.clone() if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in state.items()}
