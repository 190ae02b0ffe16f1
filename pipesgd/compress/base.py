"""The compressor contract.

A compressor is a pure function pair on tensors; it never talks to the network. The transport
(a ring hop, a tree edge, a parameter-server push) calls ``compress`` on the sender and
``decompress`` on the receiver, and sizes its receive buffer with ``payload_like``: both sides
derive the same :class:`Ctx` from the chunk they are exchanging, so nothing but the payload
crosses the wire. Every tensor a compressor creates lives on the device of its input (``ctx.device``
for ``payload_like``): NCCL rejects host buffers, and a host temporary would cost a copy per hop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ..registry import Registry

REGISTRY: Registry[type[Compressor]] = Registry("compressor", facts=("identity", "payload_bytes"))


@dataclass(frozen=True)
class Ctx:
    """What a receiver must know to decode a payload: the tensor's shape, dtype and device (where
    its receive buffer and decoded values belong; never sent)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: Tensor) -> Ctx:
        return cls(tuple(t.shape), t.dtype, t.device)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class Compressor(ABC):
    """Lossy (or identity) encoding of a flat tensor into one flat payload tensor.

    ``error_feedback=True`` asks the reduction to keep an error-feedback memory for this
    compressor; the compressor itself stays stateless. Subclasses set ``name`` and, if the transport may sum payloads element-wise (a plain cast,
    as DDP's fp16 hook does), ``summable_dtype``. ``decompress`` restores ``ctx``'s shape and
    dtype; transports that accumulate (ring hops) describe their fp32 work buffer in ``ctx``.
    """

    name: ClassVar[str]
    summable_dtype: ClassVar[torch.dtype | None] = None
    rel_error: ClassVar[float | None] = None
    """The most a decoded value's relative error can be (0: exact), or None when no per-value bound
    holds (a block-scaled code); the scale map keeps the most exact of compressors that cost the same."""

    def __init__(self, error_feedback: bool = False):
        if not isinstance(error_feedback, bool):
            raise ValueError(f"compressor.error_feedback must be true or false, got {error_feedback!r}")
        # A request to the transport, not compressor state: the reduction keeps the residual
        # (see pipesgd.reduction.inring for exactly what is fed back).
        self.error_feedback = error_feedback

    @abstractmethod
    def compress(self, t: Tensor) -> tuple[Tensor, Ctx]:
        """Encode a tensor of any shape. Never modifies ``t``."""

    @abstractmethod
    def decompress(self, payload: Tensor, ctx: Ctx) -> Tensor:
        """Decode a payload produced by ``compress`` (or received into ``payload_like``)."""

    @abstractmethod
    def payload_like(self, ctx: Ctx) -> Tensor:
        """An uninitialised buffer of exactly the payload's size and dtype on ``ctx.device``, to
        receive into."""

    def wire_bytes(self, ctx: Ctx) -> int:
        """Bytes one payload for a chunk described by ``ctx`` puts on the wire (the declared
        ``payload_bytes``; tests/unit/test_plugins.py checks it against ``payload_like``)."""
        return self.payload_bytes(ctx.numel, ctx.dtype.itemsize)

    def ddp_hook(self) -> Callable | None:
        """The DDP communication hook that carries this compressor (``trainer.mode=ddp``; torch's
        ``hook(state, bucket) -> Future`` contract), or None: DDP cannot carry it (the mode refuses
        it, naming the compressors that declare one)."""
        return None

    def ddp_state(self, parameters: list, group) -> object:
        """The state :meth:`ddp_hook` runs with, reducing over ``group`` (None: the world): torch's
        stateless hooks take the process group itself."""
        return group

    def ddp_options(self, model) -> dict:
        """Keyword arguments DDP needs for :meth:`ddp_hook` (e.g. ``bucket_cap_mb``); none by default."""
        return {}

    def ddp_wire_bytes(self) -> int:
        """Bytes per gradient element :meth:`ddp_hook` sends, as an ideal ring counts them (DDP
        does not say what it sent): one element's payload."""
        return self.payload_bytes(1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def register(name: str, **facts):
    """Class decorator: make a compressor constructible by ``name`` (library and Hydra alike)."""
    return REGISTRY.register(name, **facts)


def available() -> list[str]:
    return sorted(REGISTRY)


def get_compressor(spec: str | Compressor | None, **kwargs) -> Compressor:
    """Resolve a name (``"int8"``), an instance, or ``None`` (= ``"none"``) to a compressor."""
    if isinstance(spec, Compressor):
        return spec
    name = "none" if spec is None else spec
    if name not in REGISTRY:
        raise ValueError(f"compressor={name!r} is not known; allowed: {', '.join(available())}")
    return REGISTRY[name](**kwargs)
