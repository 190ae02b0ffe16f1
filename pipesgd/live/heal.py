"""A heal's state: what a donor replica group hands a healer, taken on the donor's training thread
at a step boundary (:class:`Snapshot`), and how the healer loads it. docs/reliability.md, "Live
recovery", says what travels and what a heal costs.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import torch
from torch import nn

from ..comm import Handle
from ..flat import state_to_device

RESERVED = ("model", "optimizer", "engine")  # the keys of the state no registered extra may take
Extras = dict[str, tuple[Callable[[], object], Callable[[object], None]]]  # key: (save, load)


def donor_state(module: nn.Module, optimizer: torch.optim.Optimizer, engine: dict, extras: Extras) -> dict:
    """What a healer loads: the weights and buffers, the optimizer, the engine's ``engine`` state
    and each extra's ``save()``, on the CPU. A copy: torchft serializes it on its own thread while
    the donor goes on updating the weights and the momentum in place."""
    return copy.deepcopy(state_to_device({
        "model": module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "engine": engine,
        **{key: save() for key, (save, _) in extras.items()},
    }, "cpu"))


def load_donor_state(state: dict, module: nn.Module, optimizer: torch.optim.Optimizer,
                     load_engine: Callable[[dict], None], extras: Extras, device: torch.device) -> None:
    """Load a donor's :func:`donor_state`: the weights (onto ``device``), the optimizer, the
    engine's state through ``load_engine``, then each extra's ``load``."""
    module.load_state_dict(state_to_device(state["model"], device))
    optimizer.load_state_dict(state["optimizer"])
    load_engine(state["engine"])
    for key, (_, load) in extras.items():
        load(state[key])


class Snapshot:
    """Hands torchft's quorum thread (a donor's) the state the training thread takes at its next
    step boundary: the quorum runs mid-step, before the caller's scheduler step and the next
    update, where the state is not one a healer could continue from."""

    def __init__(self):
        self._asked = threading.Event()
        self._ready = threading.Event()
        self._value: dict | None = None
        self._cancelled = False

    def take(self) -> dict:
        """On the quorum thread: block until the training thread has served a state."""
        self._ready.clear()
        self._asked.set()
        if not self._ready.wait() or self._cancelled:
            raise RuntimeError("the engine closed before it could hand its state to a healing peer")
        value, self._value = self._value, None
        return value

    def serve(self, state: Callable[[], dict]) -> None:
        """On the training thread, at a step boundary: take the state if a peer asked for it."""
        if self._asked.is_set():
            self._asked.clear()
            self._value = state()
            self._ready.set()

    def asked_or_done(self, handle: Handle, poll_s: float) -> None:
        """Sleep until a peer asks for the state or ``poll_s`` passes (then ``handle`` is checked again)."""
        if not handle.done():
            self._asked.wait(poll_s)

    def cancel(self) -> None:
        self._cancelled = True
        self._ready.set()
