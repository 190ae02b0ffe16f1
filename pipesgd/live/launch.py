"""How a live run's workers come to exist (``trainer.mode=live``): the lighthouse in this process,
then one process per replica group, each a lone worker in its own run subdirectory, each restarted
on its own when it dies (up to ``max_restarts`` times), while the others train on.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from multiprocessing.connection import wait
from pathlib import Path

from ..launch import WorkerFailed
from . import listen
from .lighthouse import Lighthouse, LighthouseOptions
from .options import (ENV_REPLICA, ENV_REPLICAS, ENV_RESTART, ENV_SPAWNED, ENV_START, LiveOptions, replica_attempt,
                      replica_env)

log = logging.getLogger(__name__)

TERMINATE_GRACE_S = 5.0


class ReplicaFailed(WorkerFailed):
    """A replica group exited non-zero more often than ``max_restarts`` allows."""


def replica_dir(run_dir: str | Path, replica: int) -> Path:
    """Where replica group ``replica`` writes its log, checkpoints and summary."""
    return Path(run_dir) / f"replica_{replica}"


def start_together(timeout_s: float) -> None:
    """Under the live launcher, wait until every replica group has started once (call it once
    this group's torchft Manager heartbeats: the first quorum then has them all; a group late to
    start would otherwise find the others done, or far ahead). A restarted group does not wait:
    its peers' marks are already there."""
    address = os.environ.get(ENV_START)
    if not address:
        return
    from datetime import timedelta

    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    store.set(f"started/{os.environ[ENV_REPLICA]}", "1")
    store.wait([f"started/{r}" for r in range(int(os.environ[ENV_REPLICAS]))])


_imported_at: float | None = None  # when this replica group's process had imported fn (set by _replica_main)


def _replica_main(env: dict[str, str], fn: Callable[..., object], args: tuple) -> None:
    global _imported_at
    _imported_at = time.time()  # fn arrived pickled: its module, torch with it, is imported by now
    os.environ.update(env)
    fn(*args)


def log_start(logger: logging.Logger) -> None:
    """Under the live launcher, log once, in the replica group's own log, its number, restart
    count and pid, and when its process was started and had imported its code (unix seconds:
    ``pipesgd.tools.bench.live_drill`` splits a returning group's time to train again with them)."""
    attempt = replica_attempt()
    if attempt is None or _imported_at is None:
        return
    logger.info("replica group %d restart %d pid %d: process started at %.3f, imports done at %.3f (unix s)",
                *attempt, os.getpid(), float(os.environ.get(ENV_SPAWNED, "nan")), _imported_at)


def settings(live: Mapping[str, object]) -> tuple[LighthouseOptions, LiveOptions]:
    """``trainer.live`` (its keys: pipesgd/schema.py's ``LiveConfig``; a key left out keeps its
    default) as the lighthouse's options and the replica groups' (address, run id and replica
    number placeholders, filled in by :func:`run`). ValueError naming ``trainer.live.<key>`` and the
    bad value: the config checks call this before any worker starts."""
    base = LighthouseOptions()
    host = live.get("host", base.host)
    lighthouse = LighthouseOptions(
        host=host, port=live.get("lighthouse_port", base.port), min_replicas=live.get("min_replicas", base.min_replicas),
        join_timeout_ms=live.get("join_timeout_ms", base.join_timeout_ms),
        heartbeat_timeout_ms=live.get("heartbeat_timeout_ms", base.heartbeat_timeout_ms),
        quorum_tick_ms=live.get("quorum_tick_ms", base.quorum_tick_ms))
    replica = LiveOptions("-", "-", 0, host=host, min_replicas=lighthouse.min_replicas)
    replica = replace(replica, timeout_s=live.get("timeout_s", replica.timeout_s),
                      quorum_timeout_s=live.get("quorum_timeout_s", replica.quorum_timeout_s),
                      init_sync=live.get("init_sync", replica.init_sync))
    return lighthouse, replica


def run(fn: Callable[..., object], args: tuple[dict, str], nproc: int, max_restarts: int = 0) -> None:
    """Run ``fn(container, replica_run_dir)`` in ``nproc`` replica groups behind one lighthouse,
    both set up as the container's ``trainer.live`` says (:func:`settings`); return when every
    group has exited 0, with the first group's summary.json copied into the run directory. Each
    group's process is told how often its group was restarted before it (``PIPESGD_LIVE_RESTART``:
    a fault injected into the group fires in its first process only) and when it was started
    (:func:`log_start`). Every process is gone when this returns or raises."""
    container, run_dir = args
    options, replica_options = settings(container.get("trainer", {}).get("live") or {})
    replicas = nproc
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum tick at info; the groups inherit it
    run_id = f"pipesgd-live-{uuid.uuid4().hex[:12]}"
    context = multiprocessing.get_context("spawn")
    procs: dict[int, multiprocessing.process.BaseProcess] = {}
    restarts = dict.fromkeys(range(replicas), 0)
    store = listen.store_master(options.host)  # start_together's
    with Lighthouse(options) as lighthouse:
        def start(replica: int) -> None:
            out = replica_dir(run_dir, replica)
            out.mkdir(parents=True, exist_ok=True)
            env = {**replica_env(replace(replica_options, lighthouse=lighthouse.address, run_id=run_id,
                                         replica=replica)),
                   ENV_REPLICAS: str(replicas), ENV_START: f"{options.host}:{store.port}",
                   ENV_RESTART: str(restarts[replica]), ENV_SPAWNED: repr(time.time())}
            p = context.Process(target=_replica_main, args=(env, fn, (container, str(out))),
                                name=f"pipesgd-live-replica-{replica}")
            p.start()
            procs[replica] = p

        try:
            for replica in range(replicas):
                start(replica)
            log.info("live run %s: %d replica group(s) behind the lighthouse at %s", run_id, replicas,
                     lighthouse.address)
            while procs:
                wait([p.sentinel for p in procs.values()])
                for replica, p in list(procs.items()):
                    if p.exitcode is None:
                        continue
                    del procs[replica]
                    if p.exitcode == 0:
                        continue
                    if restarts[replica] >= max_restarts:
                        raise ReplicaFailed(f"replica group {replica} exited with status {p.exitcode} after "
                                            f"{restarts[replica]} restart(s) (dist.max_restarts={max_restarts}); "
                                            f"its log: {replica_dir(run_dir, replica)}")
                    restarts[replica] += 1
                    log.warning("replica group %d exited with status %s; restarting it (%d of %d), the others "
                                "train on", replica, p.exitcode, restarts[replica], max_restarts)
                    start(replica)
            summary = replica_dir(run_dir, 0) / "summary.json"
            if summary.exists():
                shutil.copyfile(summary, Path(run_dir) / "summary.json")
        finally:
            for p in procs.values():
                p.terminate()
            for p in procs.values():
                p.join(TERMINATE_GRACE_S)
                if p.exitcode is None:
                    p.kill()
                    p.join()
