"""Ring allreduce (reduce-scatter + allgather) over point-to-point messages, with in-ring compression.

The tensor is cut into p chunks. In the reduce-scatter, at hop s rank r sends chunk (r-s) mod p to
its right neighbour and adds the chunk (r-s-1) mod p that arrives from its left, so after p-1 hops
rank r holds the full sum of chunk (r+1) mod p. The allgather then circulates those finished
chunks for another p-1 hops. Each rank sends 2(p-1)/p of the tensor in total, the bandwidth-optimal
amount.

With a compressor, every reduce-scatter hop decodes what arrived, adds its own values in fp32 and
re-encodes before forwarding; the owner of a finished chunk encodes it once and the allgather
forwards that exact payload, so every rank decodes identical bytes and replicas stay bit-identical.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..observability import trace
from ..compress import Compressor, Ctx, get_compressor
from ..timing.cost import Phase
from .base import CommStats, note, register, timed
from .group import group_rank, group_size, peer_name
from .p2p import batched, post


def chunk_bounds(n: int, p: int) -> list[tuple[int, int]]:
    """Split ``n`` values into ``p`` contiguous, nearly equal chunks (some empty when n < p)."""
    base, extra = divmod(n, p)
    bounds, start = [], 0
    for i in range(p):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def ring_bytes(numel: int, p: int, elem_size: int) -> int:
    """Bytes one rank sends in an uncompressed ring allreduce of ``numel`` values of ``elem_size``
    bytes over ``p`` ranks (0 for p = 1): the reference every compression ratio is taken against."""
    if p <= 1:
        return 0
    return 2 * sum(b - a for a, b in chunk_bounds(numel, p)[1:]) * elem_size


def work_buffer(tensor: Tensor, identity: bool) -> tuple[Tensor, Tensor]:
    """(flat view of ``tensor`` or a contiguous copy, buffer to accumulate in). Without compression
    the sum runs in the tensor's own dtype (as the backend does); with it, in fp32 (fp64 stays fp64)."""
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    acc_dtype = torch.float64 if flat.dtype == torch.float64 else torch.float32
    work = flat if identity or flat.dtype == acc_dtype else flat.to(acc_dtype)
    return flat, work


def write_back(tensor: Tensor, flat: Tensor, work: Tensor) -> None:
    """Copy the result in ``work`` back into ``tensor`` wherever ``work_buffer`` made copies."""
    if work.data_ptr() != flat.data_ptr():
        flat.copy_(work)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))


def _exchange(send: Tensor, recv: Tensor, right: int, left: int, group, hop: str, batch: bool) -> None:
    (rreq,), (sreq,) = post([(recv, left)], [(send, right)], group, batch)
    note(f"ring allreduce {hop}: receiving from {peer_name(group, left)}")
    rreq.wait()
    note(f"ring allreduce {hop}: sending to {peer_name(group, right)}")
    sreq.wait()


def ring_phases(nbytes: float, p: int, ratio: float = 1.0, per_node: int = 1) -> tuple[Phase, ...]:
    """The ring's cost: reduce-scatter then allgather, 2(p−1) steps of one M/(r·p) chunk each,
    (p−1)/p·M added. κ: each of the p−1 reduce-scatter hops compresses the chunk it sends and
    decompresses the one it receives (p−1 round trips on M/p), the owner encodes and decodes its
    finished chunk (one more), and the allgather decodes the p−1 chunks it receives (half trips):
    (1 + (p−1)/(2p))·M. ``per_node`` does not matter to one flat ring."""
    if p == 1:
        return ()
    return (Phase(2 * (p - 1), nbytes / (ratio * p), (p - 1) / p * nbytes, (1 + (p - 1) / (2 * p)) * nbytes,
                  chunks=p),)


@register("ring", cost=ring_phases, reference=True)
def ring_allreduce(tensor: Tensor, compressor: Compressor | str | None = None, group=None) -> CommStats:
    """Sum ``tensor`` in place across the ranks of ``group``, like ``dist.all_reduce(op=SUM)``;
    ``group`` may also be a :class:`~pipesgd.comm.group.PeerGroup` (torchft's, trainer.mode=live).

    Any length (also 0 and fewer values than ranks) and fp32/fp64/fp16/bf16. Without a compressor
    the result matches ``dist.all_reduce`` up to floating-point summation order; with one, each
    hop adds in fp32 and the error is bounded by the compressor's per-encode error (see tests).
    Blocking; run it on a :class:`~pipesgd.comm.base.CommThread` to overlap it with compute.
    Returns the bytes this rank sent and their uncompressed equivalent.
    """
    return timed(lambda: _ring(tensor, get_compressor(compressor), group))


def _ring(tensor: Tensor, comp: Compressor, group) -> CommStats:
    p = group_size(group)  # read at each reduction: a PeerGroup may have been re-formed since the last
    stats = CommStats()
    if p == 1 or tensor.numel() == 0:
        return stats
    r = group_rank(group)
    right, left = (r + 1) % p, (r - 1) % p
    batch = batched(group)

    identity = comp.identity
    flat, work = work_buffer(tensor, identity)
    bounds = chunk_bounds(flat.numel(), p)
    chunk = [work[a:b] for a, b in bounds]
    raw_size = flat.element_size()

    def count(payload: Tensor, numel: int) -> None:
        stats.wire_bytes += payload.nbytes
        stats.raw_bytes += numel * raw_size

    # Per-hop spans for the timeline; a shared no-op object when tracing is off.
    tr = trace.current()

    # Reduce-scatter.
    for s in range(p - 1):
        si, ri = (r - s) % p, (r - s - 1) % p
        with tr.span("encode", "compress", hop=s):
            payload, _ = comp.compress(chunk[si])
            ctx_r = Ctx.of(chunk[ri])
            inbox = comp.payload_like(ctx_r)
        with tr.span("reduce-scatter", "comm", hop=s):
            _exchange(payload, inbox, right, left, group, f"reduce-scatter hop {s + 1}/{p - 1}", batch)
        count(payload, chunk[si].numel())
        with tr.span("decode+add", "compress", hop=s):
            chunk[ri].add_(comp.decompress(inbox, ctx_r))

    # The owner encodes its finished chunk once and keeps the decoded value, like every receiver.
    own = (r + 1) % p
    ctx_own = Ctx.of(chunk[own])
    with tr.span("encode", "compress", hop=p - 1):
        final, _ = comp.compress(chunk[own])
        if not identity:
            chunk[own].copy_(comp.decompress(final, ctx_own))

    # Allgather: forward finished payloads unchanged.
    outgoing = final
    for s in range(p - 1):
        si, ri = (r + 1 - s) % p, (r - s) % p
        ctx_r = Ctx.of(chunk[ri])
        inbox = chunk[ri] if identity else comp.payload_like(ctx_r)
        with tr.span("allgather", "comm", hop=s):
            _exchange(outgoing, inbox, right, left, group, f"allgather hop {s + 1}/{p - 1}", batch)
        count(outgoing, chunk[si].numel())
        if not identity:
            with tr.span("decode", "compress", hop=s):
                chunk[ri].copy_(comp.decompress(inbox, ctx_r))
        outgoing = inbox

    write_back(tensor, flat, work)
    return stats

