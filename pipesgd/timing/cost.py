"""The α–β–γ–κ vocabulary an exchange declares its cost in (pure arithmetic, no torch).

Every registered allreduce declares ``cost=fn`` with ``fn(nbytes, p, ratio=1.0, per_node=1) ->
tuple[Phase, ...]`` for ``nbytes`` fp32 gradient bytes over ``p`` ranks (``per_node`` ranks per node
group) at compression ratio ``ratio``: the formula lives next to the algorithm it describes
(``pipesgd/comm/ring.py`` has the ring's), and :mod:`pipesgd.timing.model` prices the phases on a
link. docs/timing-model.md derives each formula.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    """One stretch of an exchange on one link, on the critical path.

    ``steps`` messages of ``step_bytes`` wire bytes each (already compressed): ``steps·(α +
    step_bytes·β)``; ``reduce_bytes`` of additions (γ); ``codec_bytes`` uncompressed bytes encoded
    plus decoded (κ, counted only when the payload is compressed). ``link``: ``"inter"``, the
    link the model is given, or ``"intra"``, the node-local one (hierarchical reduction).
    ``chunks``: the separately compressed pieces the gradient travels as here (a ring cuts it in
    p), which sets how many block scales a compressor adds.
    """

    steps: float
    step_bytes: float
    reduce_bytes: float = 0.0
    codec_bytes: float = 0.0
    link: str = "inter"
    chunks: int = 1


def rounds(p: int) -> int:
    """⌈log2 p⌉ computed exactly on integers: the rounds of a binomial tree over p ranks."""
    return (p - 1).bit_length()
