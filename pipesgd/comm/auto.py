"""``comm=auto``, the default: an allreduce that picks a registered one when it is bound to a
backend and a compressor (:func:`~pipesgd.comm.base.bind`): the backend's own all_reduce where
that is the fast path, the ring everywhere else (docs/gpu.md, "Which path")."""

from __future__ import annotations

from torch import Tensor

from ..compress import Compressor, get_compressor
from ..registry import registry
from .base import CommStats, bind, register
from .native import check_native
from .p2p import backend_of
from .ring import ring_phases


def default_allreduce(compressor, backend: str) -> str:
    """What ``comm=auto`` runs: ``native`` (the backend's own all_reduce on the buffer, cast for
    fp16 / bf16) for ``compressor`` none, fp16 or bf16 on NCCL, which pipelines within its hops
    and follows the NVLink / InfiniBand topology, where the hand-written ring issues 2(p-1)
    launches per reduction with a decode and an add between hops; the ``ring`` otherwise: for
    payloads that do not sum (int8), reductions with collectives of their own (top-k, PowerSGD),
    and on Gloo, where the ring is the path that was measured. ``compressor``: a resolved
    compressor or reduction."""
    if "nccl" not in str(backend) or compressor.name not in registry("compressor"):
        return "ring"  # Gloo, or a reduction with collectives of its own (top-k, PowerSGD)
    try:
        check_native(compressor)
    except ValueError:  # payloads that do not sum (int8)
        return "ring"
    return "native"


# Either pick is priced as an ideal ring (native declares the ring's cost: its algorithm is opaque to us).
@register("auto", cost=ring_phases, picks=default_allreduce)
def auto_allreduce(tensor: Tensor, compressor: Compressor | str | None = None, group=None) -> CommStats:
    """Sum ``tensor`` in place with what ``comm=auto`` picks for ``compressor`` on ``group``'s
    backend. An engine binds it once instead (:func:`~pipesgd.comm.base.bind`), so a run calls the
    pick directly."""
    comp = get_compressor(compressor)
    return bind(auto_allreduce, comp, backend_of(group))(tensor, comp, group)
