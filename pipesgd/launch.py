"""How workers come to exist.

Under torchrun (or the emulated cluster) the environment already describes the job and the entry
point runs the worker function in-process. Otherwise the launcher starts ``nproc`` local workers
through torch's own elastic agent (the machinery behind torchrun, with a rendezvous on 127.0.0.1
and a free port), so restarts, failure propagation and the env contract are torch's, not ours.
When one worker fails, torch sends the others SIGTERM and later SIGKILL; a worker that is
SIGSTOPped cannot act on SIGTERM, so :class:`_StoppedWorkerReaper` kills it as soon as a sibling
has exited instead of after torch's 30 s. No worker outlives the launcher.

Workers start from a fork server that has imported the training code once (:data:`START_METHOD`):
a spawned worker re-imports torch, Hydra and pipesgd itself, about 5 s of CPU each on a small
machine, which is most of a short job's start. The server imports but runs nothing (no CUDA, no
threads), so its forks are as clean as spawned processes; it is this launcher's child and the
workers are its children.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

# Grace between SIGTERM and SIGKILL when the agent shuts the workers down (torch's default: 30 s).
SHUTDOWN_TIMEOUT_S = 5

START_METHOD = "forkserver"
"""How the agent starts workers: forked from a server that imported :data:`PRELOAD` once."""
PRELOAD = ["torch", "torch._dynamo", "hydra", "omegaconf", "pipesgd.config", "pipesgd.data", "pipesgd.engine",
           "pipesgd.engine.build", "pipesgd.models", "pipesgd.reliability.hooks", "pipesgd.trainer"]
"""What the fork server imports before it forks: what the worker's module (pipesgd.train) imports
(and ``torch._dynamo``, which every ``torch.optim`` optimizer imports when it is built: 1.4 s),
not the module itself, which each worker runs again as ``__mp_main__`` when the job was started
as ``python -m pipesgd.train`` (runpy warns if it was imported already)."""


class WorkerFailed(RuntimeError):
    """A worker exited non-zero; the message names the rank and the worker's own error."""


class Terminated(RuntimeError):
    """The launcher itself got SIGTERM, SIGINT, SIGHUP or SIGQUIT (torch's SignalException): the job
    was stopped from outside, e.g. by scancel or a scheduler's time limit; the workers are shut down. ``status`` is the
    shell's status for the signal (128 + signum)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# What the live launcher (pipesgd/live/launch.py) tells a replica group's process of its place, read
# here, below the torchft wing, by the data split (train.py) and the tests' fault injection too.
ENV_REPLICA = "PIPESGD_LIVE_REPLICA"
ENV_REPLICAS = "PIPESGD_LIVE_REPLICAS"
ENV_RESTART = "PIPESGD_LIVE_RESTART"  # how often the launcher has restarted this replica group (0: its first process)


def replica_shard() -> tuple[int, int] | None:
    """``(shard, shards)``: which share of the training data this process of a replica group reads
    (its data position follows its group, whatever process it runs in): the group's, and in a group
    of k ranks (a torchrun job of WORLD_SIZE k, ``trainer.mode=torchft_diloco``) its rank's k-th of
    that, shard ``replica * k + rank`` of ``replicas * k``. None outside a live launch."""
    if not os.environ.get(ENV_REPLICAS):
        return None
    k = int(os.environ.get("WORLD_SIZE", "1")) if under_torchrun() else 1
    rank = int(os.environ["RANK"]) if k > 1 else 0
    return int(os.environ[ENV_REPLICA]) * k + rank, int(os.environ[ENV_REPLICAS]) * k


def replica_attempt() -> tuple[int, int] | None:
    """``(replica, restarts)``: this replica group's number and how often the live launcher has
    restarted it (0 in its first process), or None outside a live launch."""
    if not os.environ.get(ENV_REPLICAS):
        return None
    return int(os.environ[ENV_REPLICA]), int(os.environ.get(ENV_RESTART, "0"))


def run(fn: Callable[..., object], args: tuple, nproc: int, max_restarts: int = 0) -> None:
    """Run ``fn(*args)`` on every worker of the job and return when all have finished."""
    if under_torchrun():
        fn(*args)
        return
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"pipesgd-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1",
        max_restarts=max_restarts, monitor_interval=0.1, start_method=START_METHOD,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    multiprocessing.set_forkserver_preload(PRELOAD)  # read only by the forkserver start method
    try:
        with _own_signal_handlers(), _reap_stopped_workers():
            elastic_launch(config, fn)(*args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        message = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        first = (message or "").strip().splitlines()
        detail = first[-1] if first else f"exit code {failure.exitcode}"
        raise WorkerFailed(f"worker rank {rank} failed (exit code {failure.exitcode}): {detail}") from None
    except SignalException as e:
        sig = signal.Signals(e.sigval)
        raise Terminated(f"{sig.name} received: the job was stopped from outside (Ctrl-C, scancel, a scheduler's "
                         f"time limit or preemption); its workers were shut down", 128 + sig) from None


def _child_pids(pid: int | str) -> set[int]:
    pids: set[int] = set()
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in (task / "children").read_text().split())
    return pids


def _children() -> dict[int, str]:
    """The pids and states (R, S, T = stopped, Z = zombie, ...) of this process's children and
    grandchildren: the fork server and the workers it forked, not what a worker starts itself.
    Linux /proc only, empty elsewhere. Reads a few small files: about 0.1 ms."""
    pids = _child_pids("self")
    for pid in list(pids):
        pids |= _child_pids(pid)
    return {pid: state for pid in pids if (state := process_state(pid)) is not None}


def process_state(pid: int) -> str | None:
    """The kernel's state letter of process ``pid`` (R, S, T = stopped, Z = zombie, X = dead, ...),
    or None where it has none: gone, or not Linux (/proc only)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()[0]  # the name may hold spaces and ")"


def has_exited(pid: int) -> bool:
    """Gone, or a zombie its parent has not reaped yet: ``os.kill(pid, 0)`` still finds a zombie, whose
    sockets and memory are released all the same. True where /proc cannot say (not Linux)."""
    return process_state(pid) in (None, "Z", "X")


# torch's elastic agent installs its own handlers for these and leaves them behind when it returns.
_AGENT_SIGNALS = ((signal.SIGTERM, signal.SIGINT) if sys.platform == "win32"
                  else (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT))


@contextlib.contextmanager
def _own_signal_handlers() -> Iterator[None]:
    """Give the caller's signal handlers back once the launch returns or fails, so that a training loop
    which called ``pipesgd.launch`` still handles Ctrl-C and SIGTERM its own way afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: installed outside Python, nothing to restore to
                signal.signal(sig, handler)


@contextlib.contextmanager
def _reap_stopped_workers(interval_s: float = 0.2) -> Iterator[None]:
    """While the block runs, SIGKILL any stopped (SIGSTOP, state T) worker once another worker has
    exited: its job has failed, and torch's spawn context would wait 30 s for it to act on a
    SIGTERM it cannot see. Processes stopped by a debugger (state t) are left alone."""
    done = threading.Event()

    def watch() -> None:
        seen: set[int] = set()
        while not done.wait(interval_s):
            kids = _children()
            exited = bool(seen - kids.keys()) or "Z" in kids.values()
            seen |= kids.keys()
            for pid, state in kids.items():
                if exited and state == "T":
                    log.warning("worker pid %d is stopped (SIGSTOP) and its job has failed: killing it", pid)
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=watch, name="pipesgd-reaper", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def for_mode(mode: str) -> Callable[..., object]:
    """What starts ``trainer.mode=mode``'s workers: the ``launcher`` the mode declares (same
    arguments as :func:`run`; live: one process per replica group behind a lighthouse), else :func:`run`."""
    from .modes import get_mode

    return get_mode(mode).launcher or run
