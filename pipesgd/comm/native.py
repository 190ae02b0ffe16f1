"""The backend's own allreduce (Gloo / NCCL), optionally carrying a summable compressor as a cast,
the way DDP's fp16 / bf16 compression hooks do (``comm=auto`` takes it on NCCL: comm/auto.py)."""

from __future__ import annotations

from torch import Tensor

from ..observability import trace
from ..compress import Compressor, get_compressor
from .base import CommStats, note, register, timed
from .group import all_reduce, group_size
from .ring import ring_bytes, ring_phases


def check_native(comp: Compressor) -> None:
    """ValueError unless ``comp`` rides the backend's all_reduce: the identity, or a cast to a
    dtype the backend sums."""
    if not comp.identity and comp.summable_dtype is None:
        raise ValueError(
            f"compressor={comp.name!r} cannot ride the backend's all_reduce (its payloads do not sum); "
            "use comm=ring, or compressor=none|fp16|bf16 with comm=native"
        )


@register("native", cost=ring_phases, carries=check_native, casts=True)  # opaque to us: priced as an ideal ring
def native_allreduce(tensor: Tensor, compressor: Compressor | str | None = None, group=None) -> CommStats:
    """Sum ``tensor`` in place with ``dist.all_reduce`` (a :class:`~pipesgd.comm.group.PeerGroup`'s
    own all_reduce); a summable compressor casts around it (``tensor / p`` is cast and summed in
    the compressor's dtype, then multiplied by p)."""
    comp = get_compressor(compressor)
    check_native(comp)

    def run() -> CommStats:
        p = group_size(group)
        if p == 1 or tensor.numel() == 0:
            return CommStats()
        note(f"dist.all_reduce over {p} ranks (the backend does not say which peer is late)")
        tr = trace.current()
        if comp.identity:
            with tr.span("all_reduce", "comm"):
                all_reduce(tensor, group)
            wire = tensor.element_size()
        else:
            # Divided by p before the cast (DDP's fp16 hook divides before its all_reduce too): the
            # backend sums in 16 bits, so p gradients near 65504/p overflowed to inf on every rank
            # alike, with no rank's own values non-finite. Multiplied back after: the contract is a sum.
            with tr.span("encode", "compress"):
                buf = tensor.div_(p).to(comp.summable_dtype)
            with tr.span("all_reduce", "comm"):
                all_reduce(buf, group)
            with tr.span("decode", "compress"):
                tensor.copy_(buf).mul_(p)
            wire = buf.element_size()
        # Bytes an ideal ring would send; the backend's algorithm is opaque to us.
        return CommStats(wire_bytes=ring_bytes(tensor.numel(), p, wire),
                         raw_bytes=ring_bytes(tensor.numel(), p, tensor.element_size()))

    return timed(run)
