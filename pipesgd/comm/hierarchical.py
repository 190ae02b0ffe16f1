"""Hierarchical allreduce (S-Caffe): reduce inside each node, allreduce between node leaders,
broadcast inside each node.

Three phases, each over its own process group (created once by ``pipesgd.dist.node_groups``):

1. binomial-tree reduce to the node leader over the node group (``intra``), fp32, uncompressed;
2. ring allreduce among the leaders (``leaders``), WITH the compressor: the slow inter-node links
   are the only place where compression pays for its encode/decode work;
3. binomial-tree broadcast from the leader over the node group, fp32.

The ring leaves every leader with bit-identical values and the broadcast copies them exactly, so
replicas stay bit-identical. Inter-node traffic per rank drops from the ring's 2(p-1)/p·M to
2(n-1)/n·M on leaders only (n nodes); the intra-node trees move M per edge over fast local links.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from ..compress import Compressor, get_compressor
from ..timing.cost import Phase, rounds
from .base import CommStats, register, timed
from .ring import ring_allreduce, ring_phases, work_buffer, write_back
from .tree import tree_broadcast, tree_reduce

_FP32 = get_compressor("none")


def hierarchical_phases(nbytes: float, p: int, ratio: float = 1.0, per_node: int = 1) -> tuple[Phase, ...]:
    """The cost with ``per_node`` ranks per node (p = nodes × per_node): a binomial reduce and
    broadcast inside each node, 2·⌈log2 g⌉ steps of the whole fp32 gradient on the node-local link
    (⌈log2 g⌉·M added), then the compressed ring among the n node leaders on the inter-node link."""
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1 or p % per_node:
        raise ValueError(f"per_node must be an integer >= 1 dividing p for hierarchical, got p={p}, "
                         f"per_node={per_node!r}")
    n = rounds(per_node)
    local = (Phase(2 * n, nbytes, n * nbytes, link="intra"),) if per_node > 1 else ()
    return local + ring_phases(nbytes, p // per_node, ratio)


@register("hierarchical", cost=hierarchical_phases, node_groups=True)
class HierarchicalAllreduce:
    """``fn(tensor, compressor=None, group=None) -> CommStats`` over prebuilt node groups.

    Built in the worker (the groups are runtime objects): ``conf/comm/hierarchical.yaml`` is a
    partial that the composition root completes with ``intra``/``leaders`` from
    :func:`pipesgd.dist.node_groups`. ``group_size``, when given, is checked against ``intra``.
    ``group`` (what the engine passes) must span exactly the ranks the node groups partition;
    no message is sent on it. Blocking, like every algorithm in ``pipesgd.comm``.
    """

    __name__ = "hierarchical"

    def __init__(self, intra, leaders, group_size: int | None = None, name: str = "hierarchical"):
        self.intra, self.leaders, self.name = intra, leaders, name
        self.group_size = dist.get_world_size(intra) if intra is not None else 1
        if group_size is not None and group_size != self.group_size:
            raise ValueError(f"comm.group_size={group_size} but the node group has {self.group_size} ranks")

    def __call__(self, tensor: Tensor, compressor: Compressor | str | None = None, group=None) -> CommStats:
        comp = get_compressor(compressor)
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        nodes = dist.get_world_size(self.leaders) if self.leaders is not None else None
        if self.intra is not None and world % self.group_size:
            raise ValueError(f"group of {world} ranks is not split by node groups of {self.group_size}")
        return timed(lambda: self._run(tensor, comp, world, nodes))

    def _run(self, tensor: Tensor, comp: Compressor, world: int, nodes: int | None) -> CommStats:
        stats = CommStats()
        if world == 1 or tensor.numel() == 0:
            return stats
        flat, work = work_buffer(tensor, comp.identity)
        raw = flat.element_size()
        if self.group_size > 1:
            tree_reduce(work, _FP32, self.intra, stats, raw)
        if self.leaders is not None and nodes > 1:
            stats += ring_allreduce(work, comp, self.leaders)
        if self.group_size > 1:
            tree_broadcast(work, _FP32, self.intra, stats, raw)
        write_back(tensor, flat, work)
        return stats

    def __repr__(self) -> str:
        return f"HierarchicalAllreduce(group_size={self.group_size})"
