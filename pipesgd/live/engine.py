"""LiveEngine, Pipe-SGD at width 2 under torchft quorums (``trainer.mode=live``): a replica group
that dies costs the others at most the update in flight; one that comes back heals from a live peer.
docs/reliability.md, "Live recovery", has the schedule and what is lost.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn

from ..comm import REGISTRY as COMM_REGISTRY
from ..comm import CommStats, CommThread, CompletedHandle, Handle, bind
from ..reliability.checkpoint import param_checksum
from ..comm.native import native_allreduce
from ..compress import Compressor
from ..flat import flag_overflow, flatten_grads, mark_nonfinite, state_to_device
from . import require_torchft
from . import check, heal
from . import launch as live_launch
from . import manager as torchft_manager
from . import status, watch
from .group import QuorumGroup, TorchftGroup
from .options import LiveOptions
from .peers import QuorumPeers
from .reduction import forget_residual, reduce_apart, stateful
from ..modes import check_comm, check_compressor, register
from ..reduction import Reduction, resolve
from ..reliability.replicas import MOMENTS
from ..staleness import Staleness, make_staleness
from ..inflight import InFlight
from ..engine.base import Engine, ModeArgs, NonFinitePolicy, ReductionError, StepStats

log = logging.getLogger(__name__)

STALENESSES = ("none", "lookahead", "predict", "dc", "dga")  # rules whose heal is tested (docs/reliability.md)
COMMS = ("auto", "native", "ring", "tree")  # those that run over torchft's group (auto: the ring there, on Gloo)
REFUSED_COMMS = (("hierarchical", "its levels are nodes of several processes, and a live replica group is one process "
                  "(one rank of torchft's group): there is no node to reduce inside, and over one process per group "
                  "it is the ring, comm=ring"),)
WIDTH = 2  # the only width: torchft re-forms the quorum between steps (LiveEngine's docstring says why)
TAIL = 3  # after the gradient: the non-finite flag, the count of valid contributions, their losses' sum
# (then a check's sums)
Summed = tuple[Tensor, CommStats, check.Rider | None]  # a reduction's result: the summed buffer, its cost, its check


class LiveEngine(Engine):
    """Width-2 Pipe-SGD whose reductions run over torchft's reconfigurable process group.

    ``step()`` after each backward: flatten g_t; wait for reduction t-1 and let the quorum vote
    (``should_commit``): apply its average, or skip it as a non-finite step is skipped; start the
    next quorum; launch reduction t on the communication thread, which first waits for the quorum,
    so the quorum round-trip overlaps the next forward. The reduction in flight is kept in the
    engines' one schedule (``self.schedule``, :class:`pipesgd.inflight.InFlight`); this engine's apply
    is the quorum's vote. The flat buffer is ``[gradient, non-finite flag, valid count, loss]``: the summed
    gradient is divided by the summed count, so a replica that contributes nothing (a healer's
    stale gradient, zeroed, count 0) does not dilute the average; so is the summed loss (the
    one :meth:`carry_loss` handed over with that gradient), returned as ``StepStats.loss`` by
    the ``step()`` that votes the reduction in: the mean loss of the groups that contributed.

    ``allreduce`` (one of :data:`COMMS`, by name or the registered function) runs over torchft's
    group through its own send / recv / allreduce (:class:`pipesgd.live.group.TorchftGroup`),
    at the rank and size of the quorum the reduction waited for; ``compressor``: a per-chunk
    compressor it carries (int8 rides the ring and the tree). A lossy one encodes the gradient and the
    flag, as under ``pipe``; the count is summed exactly, in an all_reduce of its own. Top-k,
    PowerSGD and error feedback (``self.reduction``, :mod:`pipesgd.live.reduction`) reduce the
    gradient alone, after that tail, through the same group, and keep their state per group (a
    heal carries none of it). A reduction that fails (a lost peer, a timeout) is reported to the
    Manager, whose vote then drops the step. One held by a group that hangs (its sockets open, its
    heartbeats stopped) is given up once the lighthouse stops hearing that group, not at Gloo's
    timeout (:mod:`pipesgd.live.watch`; a stateful reduction runs on a copy of its state, kept when it ends).

    A replica that joins late heals: torchft fetches a peer's state (weights and buffers,
    optimizer, whatever :meth:`register_state` added, e.g. the scheduler, and this engine's step
    and policy state) and loads it inside the vote; the gradient it computed before that is on
    old weights, so its next reduction sends zeros. A donor's state is taken on the training
    thread at its next step boundary (after the caller's per-update scheduler step), never half
    way through an update.

    ``staleness``: a rule of :data:`STALENESSES`, applied as PipeSGD applies it at width 2 (each
    gradient reaches the rule before the update in flight lands, on the weights it was computed
    at); its state travels with a heal (the donor's, taken with the reduction its kept entry
    stands for still in flight, so the healer drops or applies it with that reduction; for the
    step it launches next, the rule takes the zeros it sends). Under ``dga`` each group holds its
    own pending local step: the groups agree on :meth:`consistent_params`, which replica checks
    and the heal's logged digest compare.

    ``check_every``: every that many committed updates (torchft's step, which every group of a
    quorum holds), the replicas' weights (:meth:`consistent_weights`) are compared on the reduction
    itself (:mod:`pipesgd.live.check`); a mismatch raises
    :class:`~pipesgd.reliability.replicas.ReplicaMismatch` from the ``step()`` that votes the reduction in,
    on every group. A share that is zeroed (a healer's) takes no part; a reduction the quorum drops
    takes its check with it. A check asked for by a call could not be agreed with a group that
    joins (its buffer would be shorter than its peers'), so the check follows the quorum's step.
    Float32 or float64 parameters (the sums are exact there).

    ``width``: 2 only, and not for want of a slot: torchft re-forms the quorum between steps (the
    Manager holds one quorum and one vote at a time, and reconfigures its group when the next
    quorum forms), so at most one reduction may be in flight across a quorum change; each is voted
    on by the next ``step()`` before that step's quorum starts. Width 1 would vote inside the step
    that launched it, another order of quorum, vote and heal than this engine's.

    Ended (collected, or alive at exit) with a reduction in flight that :meth:`flush` never voted
    in, it warns, as PipeSGD does."""

    width = WIDTH
    shared_state = ()
    averages_loss = True
    lighthouse = None  # a lighthouse this engine started for itself (a lone replica group), shut down on close

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, options: LiveOptions,
                 nonfinite: str = "abort", width: int = WIDTH, staleness: str | Staleness = "none",
                 compressor: str | Compressor | Reduction | None = "none",
                 allreduce: str | Callable[..., CommStats] = "auto", check_every: int | None = None):
        if check_every is not None and (isinstance(check_every, bool) or not isinstance(check_every, int)
                                        or check_every < 1):
            raise ValueError(f"check_every={check_every!r} is invalid: committed updates between replica checks, "
                             f"an integer >= 1, or None for none")
        if width != WIDTH:
            raise ValueError(f"trainer.width={width!r} is not available with trainer.mode=live: torchft re-forms "
                             f"the quorum between steps, so at most one reduction may be in flight across a quorum "
                             f"change (each is voted on before the next quorum starts): only width {WIDTH} runs")
        self.staleness = make_staleness(staleness)
        if self.staleness.name not in STALENESSES:
            raise ValueError(f"staleness={self.staleness.name} is not available with trainer.mode=live; allowed: "
                             f"{', '.join(STALENESSES)} (docs/reliability.md, \"Live recovery\", says why)")
        self.compressor, self._allreduce = _carried(compressor, allreduce)
        require_torchft()
        self.module, self.optimizer, self.options = module, optimizer, options
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the module has no parameter with requires_grad=True: nothing to reduce")
        self.numel = sum(p.numel() for p in self.params)
        if check_every is not None and self.params[0].dtype not in (torch.float32, torch.float64):
            raise ValueError(f"check_every={check_every} needs float32 or float64 parameters, whose sums of the "
                             f"digests' bytes are exact; these are {self.params[0].dtype}")
        self.check_every = check_every
        self.reduction = stateful(self.compressor, self._allreduce, [p.shape for p in self.params],
                                  self.params[0].device)
        self.staleness.bind(self.params, optimizer)
        self.nonfinite = NonFinitePolicy(nonfinite)
        self.steps = 0
        self.skipped_commits = 0  # updates dropped because the quorum voted against them
        self.healed = 0  # times this replica loaded a peer's state
        self.replica_checks = 0  # checks passed that compared this group's weights with another's
        self.last = StepStats()
        self._stale = False  # the gradient in hand was computed before a heal: send zeros
        self._loss: Tensor | None = None  # carry_loss's, for the next launch
        self._carried = False  # the reduction in flight carries this group's loss
        # WHEN: the reduction launched, until the next step() or flush() lets the quorum vote on it
        self.schedule: InFlight[Handle[Summed]] = InFlight(
            WIDTH, owner="a LiveEngine", remedy="call engine.flush() after the last engine.step(): it lets the quorum "
                                                "vote on the reduction in flight and applies it")
        self._extra: heal.Extras = {}
        self._snapshot = heal.Snapshot()
        self._heal_event: str | None = None  # healed, or served a healer: log the weights' digest at the next update
        self._left: list[threading.Thread] = []  # reductions given up on a silent peer (pipesgd.live.watch)
        # the quorum forms on torchft's thread while the next forward runs
        self._store, self._transport, self.group, self.manager = torchft_manager.start(
            options, self._load_peer_state, self._snapshot.take, async_quorum=True)
        self._thread = CommThread("pipesgd-live")

    def register_state(self, key: str, save: Callable[[], object], load: Callable[[object], None]) -> None:
        """Also hand ``save()`` to a healer, which calls ``load(value)`` (e.g. the scheduler's
        ``state_dict`` / ``load_state_dict``). Register the same keys on every replica."""
        if key in self._extra or key in heal.RESERVED:
            raise ValueError(f"state key {key!r} is already registered")
        self._extra[key] = (save, load)

    def carry_loss(self, loss: Tensor) -> None:
        """Send ``loss`` with the next reduction; the ``step()`` after it returns the mean over the
        groups that contributed to that reduction (call it every step on every group, or never)."""
        self._loss = loss

    def step(self) -> StepStats:
        """Reduction t-1 voted on and applied (or skipped), quorum t started, reduction t launched."""
        self._snapshot.serve(self._state)
        buf = self._flatten()
        stats = StepStats()
        # The vote on reduction t-1 closes its quorum before quorum t starts: it is due before
        # reduction t launches, once width - 1 are in flight.
        if self.schedule.due(self.steps, width=WIDTH - 1):
            self._finish(stats, self.schedule.pop()[1], launching=buf)
        else:
            self.staleness.launched(buf[:self.numel])
        self.manager.start_quorum()
        self.schedule.launch(self._launch(buf), at=self.steps)
        self.steps += 1
        self.last = stats
        return stats

    def flush(self) -> StepStats:
        """Wait for, vote on and apply the reduction in flight."""
        self._snapshot.serve(self._state)
        stats = StepStats()
        for _, handle in self.schedule.drain():
            self._finish(stats, handle)
        self._stale = False  # a heal in that vote: the next gradient is computed on the weights it loaded
        return stats

    def _flatten(self) -> Tensor:
        """``[gradient, flag, count, loss]`` with room after it for a replica check's sums."""
        n = self.numel
        buf = torch.empty(n + TAIL + MOMENTS, dtype=self.params[0].dtype, device=self.params[0].device)
        flatten_grads(self.params, buf[:n])
        mark_nonfinite(buf, n)
        buf[n + 1] = 1.0
        buf[n + 2] = 0.0 if self._loss is None else self._loss  # a device copy: no host sync
        return buf

    def _launch(self, full: Tensor) -> Handle[Summed]:
        n, stale = self.numel, self._stale
        self._carried, self._loss = self._loss is not None, None
        # Committed updates so far: the quorum's step, unless this replica heals in it (then it
        # sends nothing below). Whether a check rides is read from it, so every group agrees.
        update = self.manager.current_step()
        mine = None
        if check.due(self.check_every, update):
            with self.staleness.consistent_weights():  # one pass over the weights, on check steps only
                mine = param_checksum(self.module)
            check.carry(full[n + TAIL:], mine)
        buf = full[:n + TAIL + (MOMENTS if mine else 0)]
        if stale:  # computed on the weights this replica had before it healed
            buf.zero_()
            self._stale = False
        manager, step = self.manager, self.steps + 1

        def reduce() -> Summed:
            stats, out, rider = CommStats(), buf, None
            try:  # a failure is the quorum's to vote on (should_commit), not the thread's to keep
                manager.wait_quorum()
                if manager.errored() is None:  # else the quorum failed (no group to send on): the vote fails
                    agreed = manager.current_step()  # the quorum's: a replica that heals in it holds it now
                    if agreed != update:  # it heals: its gradient and digest are of weights it no longer holds
                        out = full[:n + TAIL + (MOMENTS if check.due(self.check_every, agreed) else 0)].zero_()
                    elif not manager.is_participating():  # torchft's rule: a replica still fetching its state
                        out.zero_()
                    if check.due(self.check_every, agreed):
                        taking_part = not stale and agreed == update and manager.is_participating()
                        rider = check.Rider(agreed, step, mine if taking_part else None)
                    group = self.group.bound()  # this quorum's: a reduction given up never reaches the next
                    peers = group.peers(self.options.replica)
                    if peers:
                        stats = self._reduce_watched(out, group, peers, step)
                    else:
                        stats = self._reduce(out, group)
            except Exception as e:  # noqa: BLE001 (a dead peer surfaces as any of several errors)
                log.warning("live reduction failed: %s", e)
                manager.report_error(e)
            return out, stats, rider

        return self._thread.submit(reduce)

    def _reduce_watched(self, buf: Tensor, group: QuorumGroup, peers: list[int], step: int) -> CommStats:
        """:meth:`_reduce`, given up once one of ``peers`` (groups of ``group``'s quorum) stops
        heartbeating (:mod:`pipesgd.live.watch`). A reduction with state of its own (top-k,
        PowerSGD, error feedback) runs on a copy of it, kept when it ends: one given up goes on in
        the background on that copy, never on the state the next reads."""
        o = self.options
        reduction = None if self.reduction is None else copy.deepcopy(self.reduction)
        stats = watch.watched(lambda: self._reduce(buf, group, reduction),
                              lambda: status.silent(o.lighthouse, o.run_id, peers),
                              f"the reduction launched at step {step}", self._left)
        if reduction is not None:
            self.reduction = reduction
        return stats

    def _reduce(self, buf: Tensor, group: QuorumGroup, reduction: Reduction | None = None) -> CommStats:
        """Sum ``buf`` over ``group``, the quorum's, at its rank and size. The identity sends the
        buffer whole. A lossy compressor carries the gradient and the flag, as PipeSGD's buffer
        (a 0 decodes as 0, an inf spoils its block, and a sum that overflowed sets the flag
        below), so the result is PipeSGD's bit for bit; the count goes apart, exact: in an int8
        block it would round (1.0 beside a largest value of 5 decodes as 0.984) and scale its
        neighbours by itself. So do the losses' sum and a replica check's sums after it."""
        n = self.numel
        reduction = self.reduction if reduction is None else reduction
        if reduction is not None:  # top-k, PowerSGD, error feedback: the tail first, the gradient apart
            return reduce_apart(reduction, buf, n, group)
        if self.compressor.identity:
            stats = self._allreduce(buf, self.compressor, group)
        else:
            stats = self._allreduce(buf[:n + 1], self.compressor, group)
            native_allreduce(buf[n + 1:], None, group)
        flag_overflow(buf, n)
        return stats

    def _finish(self, stats: StepStats, handle: Handle[Summed], launching: Tensor | None = None) -> None:
        """Vote on and apply the reduction ``handle`` (taken off the schedule). ``launching``: the gradient ``step()`` launches
        next, handed to the rule first, as PipeSGD does: on the weights it was computed at (dc
        keeps them), and after the last point a donor serves its state (``_reduced``)."""
        t0 = time.perf_counter()
        buf, stats.comm, rider = self._reduced(handle)
        t1 = time.perf_counter()
        stats.wait_s = t1 - t0
        n, healed = self.numel, self.healed
        if launching is not None:
            self.staleness.launched(launching[:n])  # the rule copies what it keeps: the reduction sums in place
        committed = self.manager.should_commit()  # loads a peer's state here when this replica heals
        if launching is not None and self.healed != healed:
            # The rule now holds the donor's state, taken before the donor launched this step: it
            # stands for this launch what the healer sends, zeros, on the donor's weights it loaded.
            self.staleness.launched(torch.zeros_like(launching[:n]))
        count = float(buf[n + 1])
        mean = float(buf[n + 2]) / count if self._carried and count >= 1 else None
        stats.metrics = {"live/participants": float(self.manager.num_participants()), "live/valid": count}
        if not committed:
            self.skipped_commits += 1
            self.staleness.skip()
            stats.skipped = True
            log.warning("step %d: the quorum did not commit (a replica failed or left); update skipped, %d so far%s",
                        self.steps, self.skipped_commits, "" if rider is None else ", and the replica check it carried")
            return
        stats.loss = mean
        if rider is not None:
            self.replica_checks += check.verify(rider, count, buf[n + TAIL:], self.check_every)
        if float(buf[n]) != 0.0:
            self.nonfinite.bad(self.steps, "on some replica")
            self.staleness.skip()
            stats.skipped = True
            return
        if count < 1:
            self.staleness.skip()
            stats.skipped = True  # nobody contributed (every replica was healing): nothing to apply
            return
        self.nonfinite.good()
        self.staleness.apply(buf[:n].div_(count))
        stats.update_s, stats.applied, stats.staleness = time.perf_counter() - t1, True, 1
        if self._heal_event is not None:  # one pass over the weights, once per heal
            with self.staleness.consistent_weights():
                log.info("weights sha256 %s after the update of step %d, the first since this replica %s",
                         param_checksum(self.module), self.steps, self._heal_event)
            self._heal_event = None

    def forward_context(self) -> AbstractContextManager:
        """The weights the staleness rule wants the next gradient at (one reduction in flight, or none)."""
        return self.staleness.forward_context(len(self.schedule))

    def consistent_params(self) -> Tensor:
        return self.staleness.consistent_params()

    def consistent_weights(self) -> AbstractContextManager:
        return self.staleness.consistent_weights()

    def peers(self) -> QuorumPeers:
        """The loop's own averages over the groups of the current quorum, after the reduction in
        flight (which may wait ``quorum_timeout_s`` for its quorum, then ``timeout_s``)."""
        o = self.options
        return QuorumPeers(self.manager, self.group, self._thread, wait_s=o.quorum_timeout_s + 2 * o.timeout_s)

    def _reduced(self, handle: Handle[Summed]) -> Summed:
        """The reduction's result. It waits for its quorum, which may wait for this replica's state
        (a peer heals): served while waiting, since nothing has been applied since the step
        boundary. ReductionError after ``timeout_s`` + ``quorum_timeout_s``."""
        limit = self.options.timeout_s + self.options.quorum_timeout_s
        deadline = time.perf_counter() + limit
        while not handle.done():
            self._snapshot.serve(self._state)
            if time.perf_counter() > deadline:
                raise ReductionError(f"the live reduction launched at step {self.steps} did not finish within "
                                     f"{limit:g} s", self._thread.activity)
            self._snapshot.asked_or_done(handle, 0.005)
        return handle.wait()

    def _state(self) -> dict:
        """What a healer loads (:func:`pipesgd.live.heal.donor_state`, a copy): taken on the training
        thread between steps, with nothing in flight that the healer will not take part in. The
        weights' digest after the next update is logged, as the healer logs its own (the first joint step)."""
        self._heal_event = "served a healing peer"
        return heal.donor_state(self.module, self.optimizer, {
            "steps": self.steps, "nonfinite": self.nonfinite.state_dict(), "staleness": self.staleness.state_dict()},
            self._extra)

    def _load_peer_state(self, state: dict) -> None:
        """A donor's :meth:`_state`, loaded inside the vote (torchft calls it from ``should_commit``)."""
        heal.load_donor_state(state, self.module, self.optimizer, self._load_engine, self._extra,
                              self.params[0].device)
        forget_residual(self.reduction)
        self._stale = True
        self._heal_event = "healed"
        self.healed += 1
        log.info("healed from a peer at its step %d (manager step %d)", self.steps, self.manager.current_step())

    def _load_engine(self, engine: dict) -> None:
        self.steps = int(engine["steps"])
        self.nonfinite.load_state_dict(engine["nonfinite"])
        self.staleness.load_state_dict(state_to_device(engine["staleness"], self.params[0].device))

    def state_dict(self) -> dict:
        """For a checkpoint: waits for the reduction in flight and keeps it (voted on at the next step)."""
        def kept(at: int, handle: Handle[Summed]) -> Handle[Summed]:
            buf, comm, rider = self._reduced(handle)
            return CompletedHandle((buf.clone(), comm, rider))

        pending = [handle.wait()[0] for handle in self.schedule.settle(kept)]
        return {"width": self.width, "steps": self.steps, "pending": pending,
                "nonfinite": self.nonfinite.state_dict(), "manager": self.manager.state_dict(),
                "staleness": self.staleness.state_dict(),
                "reduction": {} if self.reduction is None else self.reduction.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["width"] != self.width:
            raise ValueError(f"checkpoint has width={state['width']}, engine has width={self.width}")
        self.steps = int(state["steps"])
        self.nonfinite.load_state_dict(state["nonfinite"])
        self.manager.load_state_dict(state["manager"])
        self.staleness.load_state_dict(state_to_device(state.get("staleness", {}), self.params[0].device))
        if self.reduction is not None and state.get("reduction"):  # this group's own residual, warm start
            self.reduction.load_state_dict(state_to_device(state["reduction"], self.params[0].device))
        # A checkpointed reduction was voted on by a quorum that no longer exists: it is dropped,
        # with what the staleness rule kept for it; so is any in flight here.
        self.schedule.clear()
        if state["pending"]:
            self.staleness.skip()

    def summary(self) -> dict:
        return {"live_skipped_commits": self.skipped_commits, "live_healed": self.healed,
                "live_replica_checks": self.replica_checks, "live_strangers_refused": self._transport.refused}

    def close(self) -> None:
        self._snapshot.cancel()
        self._thread.close()
        watch.join_left(self._left, self.options.timeout_s + 5)  # each ends by Gloo's timeout_s
        self.manager.shutdown(wait=False)
        self._transport.shutdown()
        if self.lighthouse is not None:
            self.lighthouse.shutdown()


def _carried(compressor: str | Compressor | Reduction | None, allreduce: str | Callable[..., CommStats]
             ) -> tuple[Compressor | Reduction, Callable[..., CommStats]]:
    """The compressor and the allreduce that runs it over torchft's group (comm=auto: the ring,
    what it picks on Gloo); ValueError naming the setting the live mode cannot honour, as the
    config checks name it (:func:`pipesgd.modes.check_comm`, :func:`~pipesgd.modes.check_compressor`)."""
    name = allreduce
    if not isinstance(allreduce, str):  # a registered function, by its registered name
        name = next((n for n in COMM_REGISTRY if COMM_REGISTRY[n] is allreduce), allreduce)
    check_comm("live", name)
    comp = resolve(compressor)
    check_compressor("live", comp, name)
    return comp, bind(COMM_REGISTRY.get(name), comp, TorchftGroup.backend)


# torchft's quorums (pipesgd[live]): replica groups without a shared process group, so the replica
# check rides on the engine's reductions
@register("live", width=2, staleness=True, stalenesses=STALENESSES, reductions=True, allreduce=True, comms=COMMS,
          refused_comms=REFUSED_COMMS,
          check_on_reductions=True, elastic=False, nccl=False, launcher=live_launch.run,
          settings=live_launch.settings)
def build(a: ModeArgs) -> tuple[nn.Module, LiveEngine]:
    """The live mode from the composition root: the lighthouse, run id and replica group come from
    the environment the live launcher sets (:func:`pipesgd.live.options.options_from_env`); a
    process started without it is a lone replica group with a lighthouse of its own."""
    import uuid

    from .lighthouse import Lighthouse
    from .options import options_from_env

    live_launch.log_start(log)
    options, lighthouse = options_from_env(), None
    if options is None:
        lighthouse = Lighthouse()
        options = LiveOptions(lighthouse.address, f"lone-{uuid.uuid4().hex[:8]}", 0)
    engine = LiveEngine(a.model, a.optimizer, options, nonfinite=a.nonfinite, width=a.width, staleness=a.staleness,
                        compressor=a.compressor, allreduce=a.allreduce if a.allreduce is not None else "auto",
                        check_every=a.check_every)
    engine.lighthouse = lighthouse
    if lighthouse is None:
        # After the Manager exists: every group then heartbeats to the lighthouse before any asks
        # for a quorum, and the lighthouse forms none with half of the live groups or fewer. Before
        # it (as it was), a group slow to build its Manager found the first quorum formed without it.
        live_launch.start_together(options)
    return a.model, engine
