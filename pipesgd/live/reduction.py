"""Top-k, PowerSGD and error feedback over torchft's group (``trainer.mode=live``): the reductions
that keep state from step to step (a residual, PowerSGD's warm start), run on the live engine's
buffer ``[gradient, non-finite flag, valid count, losses' sum, a replica check's sums]``, in which
a healer's share may be zeros. docs/reliability.md, "Live recovery", says what a heal does to their state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..comm import CommStats
from ..comm.native import native_allreduce
from ..compress import Compressor
from ..flat import flag_overflow
from ..reduction import Reduction, as_reduction


def stateful(compressor: Compressor | Reduction, allreduce: Callable[..., CommStats], shapes: Sequence[torch.Size],
             device: torch.device) -> Reduction | None:
    """The reduction that carries ``compressor`` apart from the buffer's tail, bound to ``allreduce``
    (the one its dense sums run over; top-k gathers through the group itself) for parameters of
    ``shapes`` on ``device``: top-k, PowerSGD, or a per-chunk compressor with error feedback. None
    for a per-chunk compressor without it: stateless, it rides the buffer as under ``pipe``."""
    reduction = as_reduction(compressor)
    if reduction.carries_flag:  # a stateless dense sum: the per-chunk compressor without error feedback
        return None
    reduction.bind(shapes, allreduce, device)  # an in-ring compressor is checked against the allreduce here
    return reduction


def reduce_apart(reduction: Reduction, buf: Tensor, n: int, group) -> CommStats:
    """Sum ``buf`` (``n`` gradient values, then the tail) over ``group`` at its rank and size now.

    The tail (flag, count, the losses' sum, a check's sums) goes first, exact, in one all_reduce of its own: the
    summed count is the divisor the reduction needs before it sums (PowerSGD's residual is this
    group's M minus the decoded *average*, and its warm start is the summed Q over it). Then the
    gradient, as PipeSGD's exchange reduces it for a stateful reduction: a non-finite gradient
    goes as zeros (its residual or warm start must not absorb a NaN; the flag drops the step on
    every group), and the flag is set again where the sum came out non-finite. A share whose count
    is 0 (a healer's: torchft's while it fetches the state, then its stale gradient) reaches the
    sum as zeros, its residual neither added nor changed. With no valid share in the quorum there
    is nothing to sum (every group reads the same count, so none calls the reduction)."""
    grad, tail = buf[:n], buf[n:]
    share = bool(tail[1] != 0)  # 1, or 0 where the engine zeroed this group's share
    grad.masked_fill_(tail[0] != 0, 0.0)
    native_allreduce(tail, None, group)
    contributors = int(tail[1])
    stats = CommStats()
    if contributors > 0:
        stats = reduction.reduce(grad, group, zeroed=not share, contributors=contributors)
    flag_overflow(buf, n)
    return stats


def forget_residual(reduction: Reduction | None) -> None:
    """A heal: this group's error-feedback residual starts again at zero (docs/reliability.md says why)."""
    if reduction is not None and reduction.memory is not None:
        reduction.memory.residual = None
