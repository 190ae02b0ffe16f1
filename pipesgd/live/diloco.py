"""TorchftDiLoCo, torchft's own DiLoCo as a training mode (``trainer.mode=torchft_diloco``): the
peer the period-H pipeline is measured against, run as torchft 0.2.0 ships it, behind the live
launcher's lighthouse with one replica group per worker (docs/period-h.md, "Against torchft").

torchft's :class:`torchft.local_sgd.DiLoCo` hooks the inner optimizer: every ``sync_every / F``
inner steps one of the F fragments (``trainer.fragments``) ends its round. Its pseudo-gradient
(the fragment's global weights minus the local ones) is averaged over the replica groups with the
Manager's allreduce (fp32 on the CPU: torchft quantizes only with Triton), launched
``trainer.sync_delay`` inner steps (torchft's ``fragment_sync_delay``, the streaming paper's τ)
before the step that waits for it, votes on it and applies the outer step to the global weights,
which then replace the fragment's local weights (``fragment_update_alpha`` 0, torchft's default:
the τ inner steps taken meanwhile are dropped for that fragment). F = 1 with τ = 0 is blocking
DiLoCo; F > 1 is streaming DiLoCo. This module adds only what the trainer needs around it: the
global weights for evaluation (a copy of each fragment's taken right after it syncs), the bytes
the allreduce sends, the seconds a step waits on torchft's hook, and the loop's own collectives
over torchft's group.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import period
from ..comm import CommStats, CommThread
from ..engine.base import Engine, ModeArgs, NonFinitePolicy, StepStats
from .. import outer as outer_defaults
from ..engine.diloco import OuterFactory, split
from ..flat import assign_params, flat_params, flatten_grads, has_nonfinite, set_grads, state_to_device
from ..modes import register
from . import launch as live_launch
from . import manager as torchft_manager
from . import require_torchft
from .options import LiveOptions
from .peers import GroupPeers, QuorumPeers

log = logging.getLogger(__name__)

MODE = "torchft_diloco"
FP32_BYTES = 4


class _Fragment(nn.Module):
    """A model fragment as torchft's DiLoCo takes one (a module whose parameters are the model's own
    tensors, not copies), with the global weights it last synced to."""

    def __init__(self, params: list[nn.Parameter]):
        super().__init__()
        for i, p in enumerate(params):
            self.register_parameter(f"p{i}", p)
        self.tensors = params
        self.numel = sum(p.numel() for p in params)
        self.synced = flat_params(params).clone()


def ring_bytes(numel: int, world: int) -> int:
    """Payload bytes one rank sends in a ring allreduce of ``numel`` fp32 values over ``world`` ranks
    (reduce-scatter and all-gather, 2(p-1)/p of the buffer): what Gloo's ring sends for torchft."""
    return 0 if world < 2 else int(2 * (world - 1) * numel * FP32_BYTES / world)


class TorchftDiLoCo(Engine):
    """torchft's DiLoCo around ``optimizer`` (the inner optimizer over ``module``'s parameters).

    ``step()`` after each backward steps the inner optimizer, and with it torchft's hook, which
    launches and applies the fragments' outer steps on its schedule (module docstring);
    :attr:`StepStats.wait_s` is the time that hook took, :attr:`StepStats.comm` what the allreduce it
    launched at this step sends. ``consistent_weights()`` puts the global weights in the model
    (evaluation): every fragment's, as of its last sync. A non-finite gradient stops the run
    (``nonfinite`` abort only: torchft counts every inner step, so one rank cannot drop one).
    A checkpoint resumes where a fragment has just synced (:meth:`load_state_dict`)."""

    width = 1
    replicas_agree = False  # the local weights differ inside a round; the global ones agree
    averages_loss = False
    shared_state = ()
    loads_before_first_step = True  # torchft's DiLoCo is built once, from the weights a resume loads
    lighthouse = None

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, options: LiveOptions,
                 sync_every: int, fragments: int = 1, sync_delay: int = 0,
                 outer_optimizer: OuterFactory | None = None, nonfinite: str = "abort"):
        _check_schedule(sync_every, fragments, sync_delay)
        if nonfinite != "abort":
            raise ValueError(f"trainer.nonfinite={nonfinite} is not available with trainer.mode={MODE}: torchft's "
                             "DiLoCo counts every inner step on every group, so no group can drop one; use abort")
        require_torchft(f"trainer.mode={MODE}")
        self.module, self.optimizer, self.options = module, optimizer, options
        self.params = [p for p in module.parameters() if p.requires_grad]
        if len(self.params) < fragments:
            raise ValueError(f"trainer.fragments={fragments} is more than the model's {len(self.params)} parameter "
                             "tensors")
        self.sync_every, self.sync_delay = sync_every, sync_delay
        self.nonfinite = NonFinitePolicy(nonfinite)
        self.steps, self.rounds, self.skipped_commits = 0, 0, 0
        self.last = StepStats()
        self._store, self._transport, self.group, self.manager = torchft_manager.start(
            options, self._load_peer_state, self._state, async_quorum=False)
        self.fragments = [_Fragment(ps) for ps in split(self.params, fragments)]
        outer = outer_optimizer or outer_defaults.factory(sync_every, options.min_replicas)
        self.outer = [outer(f.tensors) for f in self.fragments]
        self._inner_done = 0.0
        self._timer = optimizer.register_step_post_hook(self._mark)  # before torchft's: the inner step's end
        self._diloco_args = dict(sync_every=sync_every, pin_memory=False, fragment_sync_delay=sync_delay)
        self.diloco = None  # torchft's, built at the first step or a resume, from the global weights then
        self._thread = CommThread("pipesgd-torchft-diloco")
        self._met = False  # a first quorum formed (torchft's first is at the first fragment's launch)
        self._world = 1
        # a replica group of k ranks (a torchrun job): its inner step is the group's, DDP's average
        self.group_ranks = dist.get_world_size() if dist.is_initialized() else 1

    def _start(self) -> None:
        """torchft's DiLoCo, built once, from the global weights (put in the model for its first
        copy of them), its hooks on the inner optimizer."""
        from torchft.local_sgd import DiLoCo

        with self._global_in_params():
            self.diloco = DiLoCo(self.manager, list(self.fragments), self.optimizer, self.outer, **self._diloco_args)
        self.diloco.__enter__()

    def _meet(self) -> None:
        """The groups' first quorum, at the first step or the loop's first collective, whichever comes
        first (every group has started then): the loop's collectives have a group before any sync."""
        if not self._met:
            self.manager.start_quorum()
            self._world, self._met = max(1, self.manager.num_participants()), True

    def _mark(self, *_) -> None:
        self._inner_done = time.perf_counter()

    @property
    def period(self) -> int:
        """Inner steps between two fragments' syncs (torchft's own ``sync_every / F``)."""
        return self.sync_every // len(self.fragments)

    def step(self) -> StepStats:
        """One inner step; torchft's hook prepares a fragment's exchange or syncs one when due. In a
        replica group of k ranks the gradients are first averaged over them (one all_reduce)."""
        flat = torch.empty(sum(p.numel() for p in self.params), dtype=self.params[0].dtype,
                           device=self.params[0].device)
        flatten_grads(self.params, flat)
        if self.group_ranks > 1:  # DDP's average inside the group: one all_reduce of the flat gradient
            dist.all_reduce(flat)
            flat /= self.group_ranks
            set_grads(self.params, flat)
        if has_nonfinite(flat):
            self.nonfinite.bad(self.steps, "on this replica group")
        if self.diloco is None:
            self._start()
        self._meet()
        stats = StepStats()
        local = self.steps % self.period + 1  # torchft's own count, 1..period
        committed = self.manager.current_step()
        syncing = committed % len(self.fragments)  # the fragment torchft picks: the committed step mod F
        t0 = time.perf_counter()
        self.optimizer.step()
        t1 = time.perf_counter()
        stats.update_s = self._inner_done - t0
        stats.wait_s = t1 - self._inner_done
        self.steps += 1
        if local == self.period - self.sync_delay:  # launched here: the fragment's fp32 pseudo-gradient
            self._world = max(1, self.manager.num_participants())
            sent = ring_bytes(self.fragments[syncing].numel, self._world)
            stats.comm = CommStats(wire_bytes=sent, raw_bytes=sent)
        if local == self.period:
            if self.manager.current_step() > committed:
                f = self.fragments[syncing]
                f.synced.copy_(flat_params(f.tensors))  # alpha 0: the fragment holds its global weights now
                self.rounds += 1
            else:
                self.skipped_commits += 1
                log.warning("step %d: the quorum did not commit fragment %d's outer step (a replica failed or "
                            "left); torchft restored its global weights", self.steps, syncing)
                stats.skipped = True
            stats.metrics = {"outer/round": float(self.rounds / len(self.fragments)),
                             "outer/bytes_per_step": ring_bytes(self.fragments[syncing].numel, self._world)
                             / self.period}
        stats.applied = True  # the inner step applied, whatever the outer one did
        self.last = stats
        return stats

    def flush(self) -> StepStats:
        """Nothing to apply: a round torchft has not ended stays local, as in torchft's own loop
        (evaluation reads the global weights, :meth:`consistent_weights`)."""
        return StepStats()

    def consistent_weights(self) -> AbstractContextManager:
        return self._global_in_params()

    @contextlib.contextmanager
    def _global_in_params(self) -> Iterator[None]:
        local = flat_params(self.params)
        for f in self.fragments:
            assign_params(f.tensors, f.synced)
        try:
            yield
        finally:
            assign_params(self.params, local)

    def consistent_params(self) -> Tensor:
        return torch.cat([f.synced for f in self.fragments])

    def peers(self) -> QuorumPeers:
        """The loop's own averages over the quorum's groups, on torchft's group (as under ``live``)."""
        self._meet()
        o = self.options
        quorum = QuorumPeers(self.manager, self.group, self._thread, wait_s=o.quorum_timeout_s + 2 * o.timeout_s)
        return GroupPeers(quorum) if self.group_ranks > 1 else quorum

    def _state(self) -> dict:
        """What a group that joins late loads from a peer (torchft's heal), beside the fragments'
        global weights DiLoCo registers itself."""
        return copy.deepcopy(state_to_device({"model": self.module.state_dict(),
                                              "optimizer": self.optimizer.state_dict(), "steps": self.steps,
                                              "synced": [f.synced for f in self.fragments],
                                              "outer": [o.state_dict() for o in self.outer]}, "cpu"))

    def _load_peer_state(self, state: dict) -> None:
        device = self.params[0].device
        self.module.load_state_dict(state_to_device(state["model"], device))
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        for f, synced in zip(self.fragments, state["synced"]):
            f.synced.copy_(synced)
        for o, s in zip(self.outer, state["outer"]):
            o.load_state_dict(s)
        log.info("healed from a peer at its step %d (manager step %d)", self.steps, self.manager.current_step())

    def state_dict(self) -> dict:
        """For a checkpoint: the global weights, the outer optimizers, the Manager's step. Taken
        between two fragments' syncs, a fragment's exchange may be in flight inside torchft
        (``pending`` names it): such a checkpoint is kept but cannot be resumed from."""
        position = self.steps % self.period
        in_flight = position >= self.period - self.sync_delay and self.sync_delay > 0
        return {"width": self.width, "steps": self.steps, "position": position,
                "pending": ["a fragment's exchange"] if in_flight else [],
                "synced": [f.synced.clone() for f in self.fragments], "outer": [o.state_dict() for o in self.outer],
                "manager": self.manager.state_dict(), "rounds": self.rounds, "nonfinite": self.nonfinite.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Resume before the first step, from a checkpoint taken where a fragment had just synced
        (every ``sync_every / fragments`` steps; trainer.checkpoint_every a multiple of it): torchft's
        DiLoCo keeps its place inside a period to itself, so it restarts counting there."""
        if self.diloco is not None:
            raise RuntimeError(f"trainer.mode={MODE} resumes before its first step only")
        if state["position"] != 0:
            raise ValueError(f"this checkpoint of trainer.mode={MODE} was taken at step {state['steps']}, "
                             f"{state['position']} steps into a fragment's period of {self.period}: torchft's DiLoCo "
                             "cannot resume there (its place in the period is its own); resume from a checkpoint at "
                             f"a multiple of {self.period} steps (trainer.checkpoint_every a multiple of "
                             "trainer.sync_every / trainer.fragments)")
        self.steps, self.rounds = int(state["steps"]), int(state["rounds"])
        self.nonfinite.load_state_dict(state["nonfinite"])
        self.manager.load_state_dict(state["manager"])
        for f, synced, o, outer in zip(self.fragments, state["synced"], self.outer, state["outer"]):
            f.synced.copy_(synced)
            o.load_state_dict(outer)
        self._start()

    def summary(self) -> dict:
        return {"sync_every": self.sync_every, "fragments": len(self.fragments), "sync_delay": self.sync_delay,
                "rounds": self.rounds // len(self.fragments), "outer_rule": "torchft", "group_ranks": self.group_ranks,
                "live_skipped_commits": self.skipped_commits, "outer_step": outer_defaults.describe(self.outer[0])}

    def close(self) -> None:
        self._timer.remove()
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)
        self._thread.close()
        self.manager.shutdown(wait=False)
        self._transport.shutdown()
        if self.lighthouse is not None:
            self.lighthouse.shutdown()


def _check_schedule(sync_every: int, fragments: int, sync_delay: int) -> None:
    """torchft's own rules, said with the settings' names before torchft asserts them."""
    period.check(sync_every, fragments, sync_delay, prefix="trainer.")


@register(MODE, width=1, compressors=("none",), nonfinite_skip=False, sync_every=True, sync_delay=True,
          rounds_only=True,
          replicas_agree=False, elastic=False, nccl=False, fixed_comm="native", launcher=live_launch.run_groups,
          settings=live_launch.settings, settings_key="live")
def build(a: ModeArgs) -> tuple[nn.Module, TorchftDiLoCo]:
    """From the composition root, as the live mode is built: the lighthouse, run id and replica group
    come from the environment the live launcher sets; a process started without it is a lone group
    with a lighthouse of its own."""
    import uuid

    from .lighthouse import Lighthouse
    from .options import options_from_env

    live_launch.log_start(log)
    options, lighthouse = options_from_env(), None
    if options is None:
        lighthouse = Lighthouse()
        options = LiveOptions(lighthouse.address, f"lone-{uuid.uuid4().hex[:8]}", 0)
    engine = TorchftDiLoCo(a.model, a.optimizer, options, a.sync_every, fragments=a.fragments,
                           sync_delay=a.sync_delay, outer_optimizer=a.outer_optimizer, nonfinite=a.nonfinite)
    engine.lighthouse = lighthouse
    if lighthouse is None:
        live_launch.start_together(options)
    return a.model, engine
