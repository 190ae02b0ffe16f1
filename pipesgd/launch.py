"""How workers come to exist.

Under torchrun (or the emulated cluster) the environment already describes the job and the entry
point runs the worker function in-process. Otherwise the launcher starts ``nproc`` local workers
through torch's own elastic agent (the machinery behind torchrun, with a rendezvous on 127.0.0.1
and a free port), so restarts, failure propagation and the env contract are torch's, not ours.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable

log = logging.getLogger(__name__)


class WorkerFailed(RuntimeError):
    """A worker exited non-zero; the message names the rank and the worker's own error."""


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run(fn: Callable[..., object], args: tuple, nproc: int, max_restarts: int = 0) -> None:
    """Run ``fn(*args)`` on every worker of the job and return when all have finished."""
    if under_torchrun():
        fn(*args)
        return
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"pipesgd-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1",
        max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn",
    )
    try:
        elastic_launch(config, fn)(*args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        message = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        first = (message or "").strip().splitlines()
        detail = first[-1] if first else f"exit code {failure.exitcode}"
        raise WorkerFailed(f"worker rank {rank} failed (exit code {failure.exitcode}): {detail}") from None
