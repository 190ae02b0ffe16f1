"""The training loop's own collectives across the replica groups of a live run
(``trainer.mode=live``): :class:`QuorumPeers`, the :class:`~pipesgd.peers.Peers` of
:class:`~pipesgd.engine.live.LiveEngine`. docs/reliability.md, "Live recovery", "The loop's own
collectives", says what each of them does there and why."""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from ..comm import CommThread
from .group import TorchftGroup

log = logging.getLogger(__name__)


class QuorumPeers:
    """Averages over the groups of the quorum of the reduction in flight, with torchft's group,
    on the engine's communication thread after that reduction (one order with the reductions on
    every group). The groups share no process group of torch.distributed's, and none is needed.

    The average runs only where every group of the quorum takes part in it, which each group
    reads from the quorum alone, so they all agree: the quorum formed (no error so far this step),
    and every group in it participates (none is fetching a peer's state: a healer's weights and
    step are not yet its peers'). Every participating group calls it at the same step: they hold
    one step and evaluate at the same ones (a healer evaluates at the step it lands on,
    :meth:`pipesgd.trainer.Trainer.seek`). Otherwise, or where the sum fails (a group died during
    it: Gloo's error, or ``timeout_s`` for a group that stopped answering), this group keeps its
    own values, logs why, and says it was alone (1). A failed sum is reported to the Manager, as
    torchft reports a failed operation on its group: the vote then drops the update in flight,
    and the next quorum re-forms the group.

    Each group scores the whole test set (``shares_evaluation`` False): with the same weights and
    the same averaged buffers every group's score is the same, and no collective that a dying
    group could fail stands between a group and its score."""

    shares_evaluation = False

    def __init__(self, manager, group: TorchftGroup, thread: CommThread, wait_s: float):
        self.manager, self.group, self.thread, self.wait_s = manager, group, thread, wait_s

    def average(self, tensors: list[Tensor], what: str) -> int:
        # float64: the counts and sums of a few groups' float32 values are exact there; the last
        # entry counts the groups the sum holds
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors]
                         + [torch.ones(1, dtype=torch.float64, device=tensors[0].device if tensors else None)])
        handle = self.thread.submit(lambda: self._sum(flat))
        try:
            why = handle.wait(self.wait_s)
        except Exception as e:  # noqa: BLE001 (a timeout, or the thread failed on an earlier reduction)
            self.manager.report_error(e)
            why = f"the communication thread did not finish it within {self.wait_s:g} s: {e}"
        if why is not None:
            log.warning("%s over the live replica groups not done (%s): this group's own values", what, why)
            return 1
        count = int(flat[-1].item())
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_((flat[offset:offset + n] / count).view_as(t))
            offset += n
        return count

    def sum(self, tensor: Tensor, what: str) -> None:
        raise RuntimeError(f"{what}: each live replica group scores the whole test set; nothing is summed")

    def _sum(self, flat: Tensor) -> str | None:
        """On the communication thread: ``flat`` summed over the quorum's groups, or why not."""
        manager = self.manager
        try:
            manager.wait_quorum()
            if manager.errored() is not None:
                return f"this group's step already failed: {manager.errored()}"
            size, participants = self.group.size(), manager.num_participants()
            if not manager.is_participating() or participants != size:
                return f"only {participants} of the {size} groups in the quorum hold its step (the others heal)"
            if size > 1:
                self.group.all_reduce(flat)
            return None
        except Exception as e:  # noqa: BLE001 (a dead peer surfaces as any of several errors)
            manager.report_error(e)
            return f"the sum failed: {e}"
