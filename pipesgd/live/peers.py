"""The training loop's own collectives across the replica groups of a live run
(``trainer.mode=live``): :class:`QuorumPeers`, the :class:`~pipesgd.peers.Peers` of
:class:`~pipesgd.live.engine.LiveEngine`. docs/reliability.md, "Live recovery", "The loop's own
collectives", says what each of them does there and why."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm import CommThread
from .group import TorchftGroup

log = logging.getLogger(__name__)

TAIL = 3  # after the averaged values: the count of groups, the sum of their committed steps, of its squares


class QuorumPeers:
    """One evaluation's collectives over the groups of the quorum of the reduction in flight, with
    torchft's group, on the engine's communication thread after that reduction (one order with
    the reductions on every group). The groups share no process group of torch.distributed's.

    :meth:`average` runs only where every group of the quorum takes part, which each group reads
    from the quorum alone, so they all agree: every group in it participates (none is fetching a
    peer's state: a healer's weights and step are not yet its peers'). Every participating group
    calls it at the same step: they hold one step and evaluate at the same ones (a healer
    evaluates at the step it lands on, :meth:`pipesgd.trainer.Trainer.seek`). Otherwise, or where
    the sum fails (a group died during it: Gloo's error, or ``timeout_s`` for a group that stopped
    answering), this group keeps its own values, logs why, and says it was alone (1). A failed
    collective is reported to the Manager, as torchft reports a failed operation on its group: the
    vote then drops the update in flight, and the next quorum re-forms the group.

    The average also sums each group's committed step and its square: where the groups that took
    part hold one step (so the same weights), each scores its share of the test set, by its rank
    in the quorum (:meth:`evaluation_share`), and :meth:`sum` adds the shares; where that sum
    fails (a group died while scoring), the caller scores the other shares itself."""

    def __init__(self, manager, group: TorchftGroup, thread: CommThread, wait_s: float):
        self.manager, self.group, self.thread, self.wait_s = manager, group, thread, wait_s
        self._share: tuple[int, int] | None = None

    def average(self, tensors: list[Tensor], what: str) -> int:
        # float64: the sums of a few groups' float32 values, the count and the steps are exact there
        device = tensors[0].device if tensors else None
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors]
                         + [torch.zeros(TAIL, dtype=torch.float64, device=device)])
        rank = self._run(lambda: self._average(flat), what)
        if rank is None:
            return 1
        count, steps, squares = flat[-TAIL:].tolist()
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_((flat[offset:offset + n] / count).view_as(t))
            offset += n
        if count * squares == steps * steps:  # Cauchy-Schwarz: every group at one committed step
            self._share = (rank, int(count)) if count > 1 else None
        else:
            log.warning("%s: the %d groups hold different committed steps (a vote failed on some), so each scores "
                        "the whole test set with its own weights", what, int(count))
        return int(count)

    def evaluation_share(self) -> tuple[int, int] | None:
        return self._share

    def sum(self, totals: Tensor, what: str) -> bool:
        if self._share is None:
            return True  # this group scored the whole set
        summed = totals.clone()  # a sum that fails half way leaves totals as they were

        def reduce() -> int:
            self.group.all_reduce(summed)
            return 0

        if self._run(reduce, what) is None:
            return False
        totals.copy_(summed)
        return True

    def _run(self, job: Callable[[], int], what: str) -> int | None:
        """``job()`` on the communication thread, within ``wait_s``; its result, or None where it
        did not run or failed (logged, a failure reported to the Manager)."""

        def guarded() -> tuple[int | None, str]:
            try:
                return job(), ""
            except _NotEveryGroup as e:
                return None, str(e)
            except Exception as e:  # noqa: BLE001 (a dead peer surfaces as any of several errors)
                self.manager.report_error(e)
                return None, f"it failed: {e}"

        try:
            value, why = self.thread.submit(guarded).wait(self.wait_s)
        except Exception as e:  # noqa: BLE001 (a timeout, or the thread failed on an earlier reduction)
            self.manager.report_error(e)
            value, why = None, f"the communication thread did not finish it within {self.wait_s:g} s: {e}"
        if value is None:
            log.warning("%s over the live replica groups not done (%s): this group's own", what, why)
        return value

    def _average(self, flat: Tensor) -> int | None:
        """On the communication thread: ``flat`` summed over the quorum's groups with this
        group's count and committed step in its tail; this group's rank in the quorum, or None
        (with the reason raised) where not every group takes part."""
        manager = self.manager
        manager.wait_quorum()
        size, participants = self.group.size(), manager.num_participants()
        if not manager.is_participating() or participants != size:
            raise _NotEveryGroup(f"only {participants} of the {size} groups in the quorum hold its step "
                                 "(the others heal)")
        step = float(manager.current_step())
        flat[-TAIL:] = torch.tensor([1.0, step, step * step], dtype=torch.float64)
        if size > 1:
            self.group.all_reduce(flat)
        return self.group.rank()


class GroupPeers:
    """The loop's collectives where a replica group is k ranks (a torchrun job; ``trainer.mode=
    torchft_diloco``): inside the group over torch.distributed's default group (the job's), across
    the groups by ``quorum`` (rank j of each group with rank j of the others, :class:`QuorumPeers`).
    Each rank scores its share of its own slice of the test set; the slices are added inside the
    group where every rank's sum across the groups succeeded, else each rank keeps its own slice's
    complete score (its other shares scored by the caller): a metric over 1/k of the sample."""

    def __init__(self, quorum: QuorumPeers):
        self.quorum = quorum

    def average(self, tensors: list[Tensor], what: str) -> int:
        world = dist.get_world_size()
        for t in tensors:
            dist.all_reduce(t)
            t /= world
        return self.quorum.average(tensors, what)

    def evaluation_share(self) -> tuple[int, int] | None:
        return self.quorum.evaluation_share()

    def sum(self, totals: Tensor, what: str) -> bool:
        done = self.quorum.sum(totals, what)
        # every rank takes part in both collectives, whatever its own sum did: none waits alone
        every = torch.tensor([float(done)], device=totals.device)
        dist.all_reduce(every, op=dist.ReduceOp.MIN)
        if every.item() == 1.0:
            dist.all_reduce(totals)
        else:
            log.warning("%s: a rank of this group could not sum across the groups, so each rank keeps its own "
                        "slice of the test set", what)
        return done


class _NotEveryGroup(Exception):
    """Not every group of the quorum takes part: this one does not either (no failure)."""
