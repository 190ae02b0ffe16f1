"""Deterministic fault injection for the reliability tests (docs/reliability.md).

``PIPESGD_FAULT=kind:rank:step[,kind:rank:step...]`` makes rank ``rank`` misbehave right after
the backward pass of step ``step`` (1-based, as the progress log counts), on the job's first
attempt only (``TORCHELASTIC_RESTART_COUNT`` unset or 0), like a transient fault:

* ``kill``: SIGKILL itself (a preempted or crashed worker);
* ``stop``: SIGSTOP itself (a peer that stops answering but keeps its sockets open);
* ``nan``: set its first gradient value to NaN (a numerical blow-up on one rank);
* ``perturb``: add 1e-3 to its first parameter value (silent replica drift);
* ``hang``: wait for a signal, forever (a job that a scheduler cancels or times out mid-run: the
  run stands at a known step, with a known newest checkpoint, until the signal comes).

Under ``trainer.mode=live`` every replica group is a lone process of rank 0, so ``rank`` names the
replica group (``pipesgd.launch.replica_attempt``) and the attempt is the number of times the
live launcher (or, for a group run as its own torchrun job, torchrun) has restarted that group
(``PIPESGD_LIVE_RESTART``): ``kill:1:35`` kills group 1 once, and its restarted process trains on.

An environment variable rather than a config key: it is not a setting of the run and it reaches
workers started by any launcher. It is read once, when a worker builds its hooks
(:meth:`Faults.from_env`): unset, or naming none of this rank's faults, nothing is installed and
the training step never calls in here.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

import torch
from torch import nn

from ..launch import replica_attempt

log = logging.getLogger(__name__)

ENV = "PIPESGD_FAULT"
KINDS = ("kill", "stop", "nan", "perturb", "hang")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int


def parse(spec: str) -> list[Fault]:
    """``"kill:1:35,nan:0:3"`` -> faults; ValueError naming the bad part and the format."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        fields = part.split(":")
        try:
            kind, rank, step = fields[0], int(fields[1]), int(fields[2])
            if len(fields) != 3 or kind not in KINDS or rank < 0 or step < 1:
                raise ValueError
        except (ValueError, IndexError):
            raise ValueError(f"{ENV}={spec!r}: bad fault {part!r}; expected kind:rank:step with kind one of "
                             f"{', '.join(KINDS)}, rank >= 0 and step >= 1, e.g. kill:1:35") from None
        faults.append(Fault(kind, rank, step))
    return faults


class Faults:
    """The faults of this rank (``who`` names it in the log) on this attempt; :meth:`after_backward`
    fires the due ones."""

    def __init__(self, faults: list[Fault], rank: int, attempt: int = 0, who: str = "rank"):
        self.mine = [f for f in faults if f.rank == rank] if attempt == 0 else []
        self.rank, self.who = rank, who

    @classmethod
    def from_env(cls, rank: int) -> Faults | None:
        """The faults ``PIPESGD_FAULT`` gives ``rank`` on this attempt (``TORCHELASTIC_RESTART_COUNT``);
        in a replica group of the live launcher, those it gives the group on the group's attempt.
        None when it gives none (the variable unset in every ordinary run): nothing to install."""
        spec = os.environ.get(ENV, "")
        if not spec:
            return None
        live = replica_attempt()
        if live is not None:
            faults = cls(parse(spec), *live, who="replica group")
        else:
            faults = cls(parse(spec), rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        return faults if faults.mine else None

    def after_backward(self, step: int, model: nn.Module) -> None:
        for f in self.mine:
            if f.step == step:
                self._fire(f, model)

    def _fire(self, f: Fault, model: nn.Module) -> None:
        log.warning("fault injection (%s): %s %d (pid %d) does %r at step %d",
                    ENV, self.who, self.rank, os.getpid(), f.kind, f.step)
        for h in logging.getLogger().handlers:
            h.flush()
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif f.kind == "hang":
            while True:
                signal.pause()
        else:
            p = next(p for p in model.parameters() if p.requires_grad)
            with torch.no_grad():
                if f.kind == "nan":
                    p.grad.view(-1)[0] = float("nan")
                else:
                    p.view(-1)[0] += 1e-3
