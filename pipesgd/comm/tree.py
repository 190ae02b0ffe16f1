"""Binomial-tree allreduce (FireCaffe): reduce to a root, then broadcast, over point-to-point messages.

Ranks are numbered inside ``group``; the root is group rank 0. In the reduce, rank r receives from
its children r + 2^k (every k below the lowest set bit of r; every k for the root), adds what
arrives, and sends its partial sum to its parent r - lowbit(r). The broadcast runs the same tree
downwards. Each phase takes ⌈log2 p⌉ rounds and every edge carries the WHOLE tensor, so the tree
wins over the ring only where per-message latency dominates (small tensors, many ranks).

With a compressor, the compressor hook-up is the ring's: every child encodes its partial sum, the
parent decodes, adds in fp32 and re-encodes on the way up; the root encodes the final sum ONCE,
keeps the decoded value, and the broadcast forwards that exact payload, so every rank decodes
identical bytes and replicas stay bit-identical. Every rank's contribution is encoded at most
⌈log2 p⌉ + 1 times on its way to the result, and p encodes in total shape any one value's error
(p - 1 children's partial sums plus the root's final encode): the ring's bound.

``group`` may also be a :class:`~pipesgd.comm.group.PeerGroup` (torchft's, trainer.mode=live): rank
and size are read once, when the reduction starts, and every hop is posted through the group's own
``isend`` / ``irecv`` (comm/p2p.py), as the ring's are.
"""

from __future__ import annotations

from torch import Tensor

from ..compress import Compressor, Ctx, get_compressor
from ..timing.cost import Phase, rounds
from .base import CommStats, note, register, timed
from .group import group_rank, group_size, peer_name
from .p2p import batched, post
from .ring import work_buffer, write_back


def _lowbit(r: int) -> int:
    return r & -r


def children(r: int, p: int) -> list[int]:
    """Children of group rank ``r`` in the binomial tree rooted at 0, nearest first."""
    limit = _lowbit(r) if r else 1 << (p - 1).bit_length()
    out, k = [], 1
    while k < limit and r + k < p:
        out.append(r + k)
        k <<= 1
    return out


def parent(r: int) -> int | None:
    return r - _lowbit(r) if r else None


def _count(stats: CommStats, payload: Tensor, numel: int, raw_size: int) -> None:
    stats.wire_bytes += payload.nbytes
    stats.raw_bytes += numel * raw_size


def _place(group, at: tuple[int, int] | None) -> tuple[int, int]:
    """(group size, this rank): ``at`` as the reduction read them when it started, else read now."""
    return at if at is not None else (group_size(group), group_rank(group))


def tree_reduce(work: Tensor, comp: Compressor, group, stats: CommStats, raw_size: int,
                at: tuple[int, int] | None = None) -> None:
    """Sum ``work`` (flat) over ``group`` into group rank 0's ``work``; other ranks' ``work`` is left
    holding their subtree's partial sum. Adds in ``work``'s dtype, decoding compressed children.
    ``at``: (group size, this rank) as read when the reduction started (None: read now)."""
    p, r = _place(group, at)
    identity = comp.identity
    batch = batched(group)
    ctx = Ctx.of(work)
    kids = children(r, p)
    # All receives are posted before this rank sends: children finish in any order.
    inboxes = [comp.payload_like(ctx) if not identity else work.new_empty(work.shape) for _ in kids]
    reqs, _ = post(list(zip(inboxes, kids)), [], group, batch)
    for req, box, c in zip(reqs, inboxes, kids):  # fixed order: the same sum on every run
        note(f"tree allreduce reduce: receiving from {peer_name(group, c)}")
        req.wait()
        work.add_(box if identity else comp.decompress(box, ctx))
    up = parent(r)
    if up is not None:
        payload = work if identity else comp.compress(work)[0]
        note(f"tree allreduce reduce: sending to {peer_name(group, up)}")
        _, (req,) = post([], [(payload, up)], group, batch)
        req.wait()
        _count(stats, payload, work.numel(), raw_size)


def tree_broadcast(work: Tensor, comp: Compressor, group, stats: CommStats, raw_size: int,
                   at: tuple[int, int] | None = None) -> None:
    """Group rank 0's ``work`` on every rank of ``group``. With a compressor the root encodes once
    and replaces its own value with the decoded payload, so all ranks end bit-identical. ``at``:
    as for :func:`tree_reduce`."""
    p, r = _place(group, at)
    identity = comp.identity
    batch = batched(group)
    ctx = Ctx.of(work)
    up = parent(r)
    if up is not None:
        note(f"tree allreduce broadcast: receiving from {peer_name(group, up)}")
    if identity:
        payload = work
    elif up is None:
        payload = comp.compress(work)[0]
    else:
        payload = comp.payload_like(ctx)
    if up is not None:
        (req,), _ = post([(payload, up)], [], group, batch)
        req.wait()
    decoded = identity
    # One child at a time, farthest (largest subtree) first: that child starts forwarding while
    # this rank serves the next, so the broadcast takes L rounds. Sent all at once, the children
    # share this rank's link and the farthest one starts a round per sibling late: L(L+1)/2.
    for c in reversed(children(r, p)):
        note(f"tree allreduce broadcast: sending to {peer_name(group, c)}")
        _, (req,) = post([], [(payload, c)], group, batch)
        if not decoded:  # this rank's own decode overlaps the first send (both only read payload)
            work.copy_(comp.decompress(payload, ctx))
            decoded = True
        req.wait()
        _count(stats, payload, work.numel(), raw_size)
    if not decoded:
        work.copy_(comp.decompress(payload, ctx))


def tree_phases(nbytes: float, p: int, ratio: float = 1.0, per_node: int = 1) -> tuple[Phase, ...]:
    """The tree's cost: binomial reduce to a root then binomial broadcast, L = ⌈log2 p⌉ rounds
    each, every round moving the whole (compressed) gradient one hop: 2L steps of M/r, L·M added.
    κ: the receiver of each reduce round decodes and its sender had encoded, the broadcast
    encodes once at the root and decodes once at each leaf: (L+1)·M."""
    if p == 1:
        return ()
    n = rounds(p)
    return (Phase(2 * n, nbytes / ratio, n * nbytes, (n + 1) * nbytes),)


@register("tree", cost=tree_phases)
def tree_allreduce(tensor: Tensor, compressor: Compressor | str | None = None, group=None) -> CommStats:
    """Sum ``tensor`` in place across the ranks of ``group``, like ``dist.all_reduce(op=SUM)``.

    Same contract as :func:`~pipesgd.comm.ring.ring_allreduce` (any length and float dtype;
    blocking; returns the bytes this rank sent and their uncompressed equivalent; ``group`` may be
    a :class:`~pipesgd.comm.group.PeerGroup`). A non-root rank
    sends the tensor once up and once per child down; the root sends once per child.
    """
    return timed(lambda: _tree(tensor, get_compressor(compressor), group))


def _tree(tensor: Tensor, comp: Compressor, group) -> CommStats:
    stats = CommStats()
    at = (group_size(group), group_rank(group))  # once: a PeerGroup may have been re-formed since the last
    if at[0] == 1 or tensor.numel() == 0:
        return stats
    flat, work = work_buffer(tensor, comp.identity)
    tree_reduce(work, comp, group, stats, flat.element_size(), at)
    tree_broadcast(work, comp, group, stats, flat.element_size(), at)
    write_back(tensor, flat, work)
    return stats
