"""How a live run's workers come to exist (``trainer.mode=live``): the lighthouse in this process,
then one process per replica group, each a lone worker in its own run subdirectory, each restarted
on its own when it dies (up to ``max_restarts`` times), while the others train on. Under torchrun
each replica group is a torchrun job of its own (one process; torchrun restarts it), told where
its run is by ``trainer.live.{lighthouse,run_id,replica,replicas}`` or the environment, and the
lighthouse runs on its own (``python -m pipesgd.live.lighthouse``): docs/multi-node.md.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import multiprocessing
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, replace
from multiprocessing.connection import wait
from pathlib import Path
from urllib.parse import urlsplit

from ..launch import WorkerFailed, under_torchrun
from . import barrier, listen
from .lighthouse import Lighthouse, LighthouseOptions
from .options import (ENV_LIGHTHOUSE, ENV_REPLICA, ENV_REPLICAS, ENV_RESTART, ENV_RUN_ID, ENV_SPAWNED, ENV_START,
                      LiveOptions, replica_attempt, replica_env)

log = logging.getLogger(__name__)

TERMINATE_GRACE_S = 5.0
# where a replica group started on its own (torchrun) finds its run: trainer.live.<key>, else the variable
GROUP_KEYS = {"lighthouse": ENV_LIGHTHOUSE, "run_id": ENV_RUN_ID, "replica": ENV_REPLICA, "replicas": ENV_REPLICAS}
# trainer.live.<key>: the option of python -m pipesgd.live.lighthouse that sets it where the lighthouse runs on its own
LIGHTHOUSE_KEYS = {"lighthouse_port": ("port", "--port"), "join_timeout_ms": ("join_timeout_ms", "--join-timeout-ms"),
                   "heartbeat_timeout_ms": ("heartbeat_timeout_ms", "--heartbeat-timeout-ms"),
                   "quorum_tick_ms": ("quorum_tick_ms", "--quorum-tick-ms")}


class ReplicaFailed(WorkerFailed):
    """A replica group exited non-zero more often than ``max_restarts`` allows."""


def replica_dir(run_dir: str | Path, replica: int) -> Path:
    """Where replica group ``replica`` writes its log, checkpoints and summary."""
    return Path(run_dir) / f"replica_{replica}"


def start_together(options: LiveOptions) -> None:
    """Wait until the other replica groups have started once (call it once this group's torchft
    Manager heartbeats: the first quorum then has them all; a group late to start would otherwise
    find the others done, or far ahead, and heal at their step). Under the live launcher, every
    group, at the launcher's store; under torchrun, ``options.start_replicas`` groups, as the
    lighthouse hears them (:mod:`pipesgd.live.barrier`), and none where that is None. A restarted
    group does not wait: its peers' marks are already there. TimeoutError naming the key of the
    limit (:meth:`LiveOptions.start_wait_s`)."""
    key, timeout_s = options.start_wait_s()
    address = os.environ.get(ENV_START)
    if not address:
        if options.start_replicas is not None:
            barrier.wait_for_groups(options.lighthouse, options.run_id, options.start_replicas, timeout_s, key)
        return
    from datetime import timedelta

    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    replicas = int(os.environ[ENV_REPLICAS])
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    store.set(f"started/{os.environ[ENV_REPLICA]}", "1")
    try:
        store.wait([f"started/{r}" for r in range(replicas)])
    except dist.DistStoreError as e:
        raise TimeoutError(f"the {replicas} replica groups did not all start within {key}={timeout_s:g} s: {e}") from e


_imported_at: float | None = None  # when this replica group's process had imported fn (set by _replica_main)


def _replica_main(env: dict[str, str], fn: Callable[..., object], args: tuple) -> None:
    global _imported_at
    _imported_at = time.time()  # fn arrived pickled: its module, torch with it, is imported by now
    os.environ.update(env)
    fn(*args)


STARTED = re.compile(r"replica group (\d+) restart (\d+) pid (\d+): process started at ([\d.]+|nan), "
                     r"imports done at ([\d.]+)")
"""The line :func:`log_start` writes, for what reads a group's log (group, restart, pid, started, imported)."""


def log_start(logger: logging.Logger) -> None:
    """Under the live launcher, log once, in the replica group's own log, its number, restart
    count and pid, and when its process was started and had imported its code (unix seconds:
    ``pipesgd_lab.bench.live_drill`` splits a returning group's time to train again with them)."""
    attempt = replica_attempt()
    if attempt is None or _imported_at is None:
        return
    # a torchrun job's worker: torchrun started it, at a time only the kernel knows (its imports are
    # done when run_here starts, after Hydra composed the config)
    started = float(os.environ[ENV_SPAWNED]) if ENV_SPAWNED in os.environ else process_started()
    if started is None:
        logger.info("replica group %d restart %d pid %d: a torchrun job's worker", *attempt, os.getpid())
        return
    logger.info("replica group %d restart %d pid %d: process started at %.3f, imports done at %.3f (unix s)",
                *attempt, os.getpid(), started, _imported_at)


def process_started() -> float | None:
    """When this process was started (unix seconds, to a clock tick), from the kernel's count of
    ticks since boot (/proc/self/stat's field 22) against /proc/uptime; None off Linux."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


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
                      init_sync=live.get("init_sync", replica.init_sync),
                      start_replicas=live.get("start_replicas"), start_timeout_s=live.get("start_timeout_s"))
    if under_torchrun():
        group_env(live, replica)
    elif replica.start_replicas is not None:
        raise ValueError(f"trainer.live.start_replicas={replica.start_replicas!r} is for replica groups started on "
                         "their own (torchrun); the live launcher starts every group and they wait for each other "
                         "at start: leave it unset")
    elif given := [k for k in GROUP_KEYS if live.get(k) is not None]:
        raise ValueError(f"trainer.live.{given[0]}={live[given[0]]!r} is for a replica group started on its own "
                         "(torchrun); without torchrun the live launcher starts the lighthouse and numbers the "
                         "groups itself: leave trainer.live.{lighthouse,run_id,replica,replicas} unset")
    return lighthouse, replica


def group_env(live: Mapping[str, object], base: LiveOptions, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Under torchrun, the variables that make this process replica group ``trainer.live.replica``
    of its run (those the live launcher would set: :func:`~pipesgd.live.options.options_from_env`
    reads them), from ``trainer.live.*`` (``base``: its parsed replica options), else from the same
    variables already set; torchrun's restart count is the group's. ValueError naming the key
    where one is missing or wrong, a lighthouse key is set (the lighthouse is not started here), or
    the servers would listen on loopback while the lighthouse is elsewhere (peers on other nodes
    could not reach them). The job is the group: one process, or k ranks where the mode takes a
    group of several (``trainer.mode=torchft_diloco``; :func:`run_here` refuses it for ``live``)."""
    defaults = asdict(LighthouseOptions())
    for key, (field, option) in LIGHTHOUSE_KEYS.items():
        if live.get(key, defaults[field]) != defaults[field]:
            raise ValueError(f"trainer.live.{key}={live[key]!r} is the lighthouse's, and under torchrun the lighthouse "
                             f"runs on its own: pass {option} to python -m pipesgd.live.lighthouse")
    values, missing = {}, []
    for key, var in GROUP_KEYS.items():
        given, set_ = live.get(key), environ.get(var)
        if given is not None and set_ and str(given) != set_:
            raise ValueError(f"trainer.live.{key}={given!r} and {var}={set_!r} disagree; give one of them")
        values[key] = str(given) if given is not None else set_
        if not values[key]:
            missing.append(key)
    if missing:
        raise ValueError(f"trainer.mode=live under torchrun: {', '.join(f'trainer.live.{k}' for k in missing)} not set "
                         f"(nor {', '.join(GROUP_KEYS[k] for k in missing)}): each replica group is told the "
                         "lighthouse's address, the run's id, its own number and how many groups the run has "
                         "(docs/multi-node.md, \"Live recovery under torchrun\")")
    counts = {}
    for key in ("replica", "replicas"):
        try:
            counts[key] = int(values[key])
        except ValueError:
            raise ValueError(f"trainer.live.{key} (or {GROUP_KEYS[key]})={values[key]!r} is invalid: must be an "
                             "integer") from None
    if not 0 <= counts["replica"] < counts["replicas"]:
        raise ValueError(f"trainer.live.replica={counts['replica']} is invalid with trainer.live.replicas="
                         f"{counts['replicas']}: must be in 0..{counts['replicas'] - 1}")
    if base.start_replicas is not None and base.start_replicas > counts["replicas"]:
        raise ValueError(f"trainer.live.start_replicas={base.start_replicas} is invalid with trainer.live.replicas="
                         f"{counts['replicas']}: a group cannot wait for more groups than the run has")
    address = urlsplit(values["lighthouse"])
    if address.scheme != "http" or not address.hostname or address.port is None:
        raise ValueError(f"trainer.live.lighthouse={values['lighthouse']!r} is invalid: must be http://host:port, as "
                         "python -m pipesgd.live.lighthouse prints it")
    if "/" in values["run_id"]:
        raise ValueError(f"trainer.live.run_id={values['run_id']!r} is invalid: must not contain '/'")
    if _loopback(base.host) and not _loopback(address.hostname):
        raise ValueError(f"trainer.live.host={base.host} is loopback but the lighthouse is at {values['lighthouse']}: "
                         "the replica groups on other nodes could not reach this one's servers; set "
                         "trainer.live.host to this node's address")
    options = replace(base, lighthouse=values["lighthouse"], run_id=values["run_id"], replica=counts["replica"])
    return {**replica_env(options), ENV_REPLICAS: str(counts["replicas"]),
            ENV_RESTART: environ.get("TORCHELASTIC_RESTART_COUNT", "0")}


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run_here(fn: Callable[..., object], args: tuple, several_ranks: bool = False) -> Path:
    """Under torchrun: run ``fn(container, replica_run_dir, *rest)`` (``args``: container, run_dir,
    *rest) in this process as the replica group the container's ``trainer.live`` (or the environment) names (:func:`group_env`), in the run
    directory's ``replica_<n>`` (its checkpoints, its log, its summary.json, as under the live
    launcher; group 0's summary is copied into the run directory). Returns the path of the
    group's summary.json. ``several_ranks``: the job may be a group of k ranks (``torchft_diloco``,
    :func:`run_groups`); otherwise a job of more than one process is refused (WorkerFailed) before it
    trains: ``live``'s engine reduces over torchft's group alone."""
    global _imported_at
    container, run_dir, *rest = args
    world = os.environ.get("WORLD_SIZE")
    if world != "1" and not several_ranks:
        raise WorkerFailed(f"trainer.mode={container['trainer']['mode']} under torchrun runs one process per replica "
                           "group, each group its own torchrun job (--nnodes 1 --nproc-per-node 1); this job has "
                           f"WORLD_SIZE={world}")
    live = container.get("trainer", {}).get("live") or {}
    env = group_env(live, settings(live)[1])
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum tick at info
    os.environ.update(env)
    _imported_at = time.time()
    replica = int(env[ENV_REPLICA])
    out = replica_dir(run_dir, replica)
    if int(os.environ["RANK"]) != 0:
        # a group's other ranks have no run directory of their own (train.cli gives them "."): the
        # worker takes its rank 0's, and they log to stderr only
        fn(container, str(out), *rest)
        return out / "summary.json"
    out.mkdir(parents=True, exist_ok=True)
    with _log_to(out / "train.log"):
        fn(container, str(out), *rest)
    if replica == 0:
        _publish_summary(run_dir)
    return out / "summary.json"


def _publish_summary(run_dir: str) -> None:
    """Group 0's summary.json copied into the run directory, whole or not at all (the local
    launcher and a torchrun group 0 both do it; a reader never sees half a file)."""
    summary = replica_dir(run_dir, 0) / "summary.json"
    if summary.exists():
        partial = Path(run_dir) / f".summary.json.{os.getpid()}"
        shutil.copyfile(summary, partial)
        os.replace(partial, Path(run_dir) / "summary.json")


@contextlib.contextmanager
def _log_to(path: Path) -> Iterator[None]:
    """The root logger's files (Hydra's train.log in the run directory, which every group of a
    shared run directory would write) swapped for ``path`` while the group runs."""
    root = logging.getLogger()
    files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
    mine = logging.FileHandler(path)
    mine.setFormatter(files[0].formatter if files else logging.Formatter(
        "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    for h in files:
        root.removeHandler(h)
    root.addHandler(mine)
    try:
        yield
    finally:
        root.removeHandler(mine)
        mine.close()
        for h in files:
            root.addHandler(h)


def run_groups(fn: Callable[..., object], args: tuple, nproc: int, max_restarts: int = 0) -> Path:
    """:func:`run` for ``trainer.mode=torchft_diloco``: under torchrun the job may be a replica group
    of k ranks (``--nproc-per-node k``, data parallel inside it, as torchft's own recipe builds one);
    the live launcher starts lone processes, as for ``live``."""
    if under_torchrun():
        return run_here(fn, args, several_ranks=True)
    return run(fn, args, nproc, max_restarts)


def run(fn: Callable[..., object], args: tuple, nproc: int, max_restarts: int = 0) -> Path:
    """Run ``fn(container, replica_run_dir, *rest)`` in ``nproc`` replica groups behind one lighthouse,
    both set up as the container's ``trainer.live`` says (:func:`settings`); return when every
    group has exited 0, with the first group's summary.json copied into the run directory (its
    path is returned). Each group's process is told how often its group was restarted before it
    (``PIPESGD_LIVE_RESTART``: a fault injected into the group fires in its first process only)
    and when it was started (:func:`log_start`). Every process is gone when this returns or raises.
    Under torchrun this process is one replica group: :func:`run_here` (``nproc`` and
    ``max_restarts`` are torchrun's then)."""
    if under_torchrun():
        return run_here(fn, args)
    container, run_dir, *rest = args
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
                   ENV_RESTART: str(restarts[replica]), ENV_SPAWNED: repr(time.time()),
                   # the groups share this machine's cores as local workers do (pipesgd.train's _threads);
                   # each took them all before, and two groups on two cores ran 1.7x slower a step
                   "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // replicas))}
            p = context.Process(target=_replica_main, args=(env, fn, (container, str(out), *rest)),
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
            _publish_summary(run_dir)
            return Path(run_dir) / "summary.json"
        finally:
            for p in procs.values():
                p.terminate()
            for p in procs.values():
                p.join(TERMINATE_GRACE_S)
                if p.exitcode is None:
                    p.kill()
                    p.join()
