"""The reduction contract: one strategy decides what one step's flat gradient becomes on the wire.

The :class:`~pipesgd.engine.exchange.GradientExchange` flattens the gradients and hands the flat tensor to a
:class:`Reduction`, which replaces it in place with the sum over ranks of what it communicates.
In-ring compressors ride the configured allreduce unchanged (:class:`~.inring.InRing`); top-k
and PowerSGD need collectives of their own (an allgather; two allreduces around an
orthogonalisation), so they are reductions, not per-chunk encoders.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
from torch import Tensor

from ..comm import CommStats
from ..registry import Registry
from .memory import ErrorFeedback

REGISTRY: Registry[type[Reduction]] = Registry("reduction", facts=("elastic_drop", "shardable"))


class Reduction(ABC):
    """Sums one flat gradient across ranks, possibly lossily, keeping whatever state that needs.

    Instances hold per-run state (error-feedback residuals, warm-start factors): use one instance
    per engine. ``bind`` is called once by the GradientExchange before the first ``reduce``; ``reduce``
    runs on the communication thread, in launch order, one call at a time. State and temporaries
    live on the device ``bind`` names (the parameters'), which is also ``flat``'s.
    """

    name: ClassVar[str]
    #: keys of :meth:`state_dict` a rank that did not exist before an elastic resume starts without
    #: (an error-feedback residual is gradient mass only its own rank owes the average)
    elastic_drop: ClassVar[tuple[str, ...]] = ("residual",)
    memory: ErrorFeedback | None = None  # error-feedback residual, if the strategy keeps one
    _numel: int = 0

    #: the non-finite flag slot may ride in the buffer :meth:`reduce` sums (a stateless dense sum);
    #: otherwise the exchange zeroes a non-finite gradient first and reduces the flag on its own
    carries_flag: bool = False

    #: :meth:`reduce` may run on a shard of the flat buffer (a cut across parameters), as replicas of
    #: several ranks exchange it (:class:`~pipesgd.reduction.sharded.Sharded`); False for one that
    #: reads the parameters' shapes (PowerSGD's matrices)
    shardable: ClassVar[bool] = True

    def bind(self, shapes: Sequence[torch.Size], allreduce: Callable[..., CommStats], device: torch.device) -> None:
        """Learn the parameter layout of the flat tensor, the allreduce to use for dense sums and the
        device the gradients (and so this reduction's state) live on."""

    @abstractmethod
    def reduce(self, flat: Tensor, group, *, zeroed: bool = False, contributors: int | None = None) -> CommStats:
        """Replace ``flat`` (this rank's gradient) in place by the sum over the ranks of ``group``
        of what is communicated; identical bits on every rank. Returns this rank's cost, with
        ``raw_bytes`` = what a dense ring allreduce of ``flat`` would have sent. ``group``: a
        torch.distributed group or a :class:`~pipesgd.comm.group.PeerGroup` (torchft's), its size
        read at each call.

        ``zeroed``: this rank's ``flat`` is zeros that must reach the sum as zeros (a live healer's
        stale gradient): its error-feedback residual is neither added nor changed. ``contributors``:
        how many ranks' shares are not zeroed, the divisor the caller averages by (None: every
        rank of ``group``); a reduction whose state depends on the average (PowerSGD's) uses it."""

    def ddp_hook(self) -> Callable | None:
        """The DDP communication hook that carries this reduction (``trainer.mode=ddp``; torch's
        ``hook(state, bucket) -> Future``), or None: DDP cannot carry it."""
        return None

    def ddp_state(self, parameters: list, group) -> object:
        """The state :meth:`ddp_hook` runs with, reducing over ``group`` (None: the world)."""
        return group

    def ddp_options(self, model) -> dict:
        """Keyword arguments DDP needs for :meth:`ddp_hook`; none by default."""
        return {}

    def ddp_wire_bytes(self) -> int:
        """Bytes per gradient element :meth:`ddp_hook` sends, as an ideal ring counts them (DDP
        does not say what it sent): fp32 by default (PowerSGD's factors are fewer bytes)."""
        return 4

    def state_dict(self) -> dict:
        """Tensors that must survive a checkpoint (error-feedback residuals, warm starts)."""
        return {} if self.memory is None else self.memory.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.memory is not None:
            self.memory.load_state_dict(state, self._numel)
        elif "residual" in state:
            raise ValueError(f"checkpoint has an error-feedback residual, compressor {self.name!r} keeps none")


def register(name: str, **facts):
    """Class decorator: make a reduction selectable as ``compressor=<name>``; the class declares
    ``elastic_drop`` (below)."""

    return REGISTRY.register(name, **facts)


def reductions() -> list[str]:
    return sorted(REGISTRY)


def get_reduction(name: str, **kwargs) -> Reduction:
    return REGISTRY.get(name)(**kwargs)


def check_fraction(key: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{key}={value!r} is invalid: must be a number in (0, 1]")
    return float(value)
