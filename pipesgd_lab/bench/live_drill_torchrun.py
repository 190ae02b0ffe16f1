"""The live drill's replica groups as torchrun jobs on emulated nodes (``python -m
pipesgd_lab.bench.live_drill --launcher torchrun``, docs/reliability.md "The drill").

An emulated cluster (:class:`~pipesgd_lab.emulate.Cluster`: a network namespace per node, root
only) of R nodes: node 0's namespace runs the lighthouse (``python -m pipesgd.live.lighthouse
--host <node 0>``), and node r runs replica group r as its own torchrun job of one process
(``--max-restarts 1``), as docs/multi-node.md "Live recovery under torchrun" starts them. Every
group writes into the one run directory (``replica_<r>/train.log`` and ``summary.json``, as under the
local launcher), so the drill's analysis reads them unchanged. The cluster is torn down, and every
process in it killed, however the run ends.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from pipesgd.live.launch import LIGHTHOUSE_KEYS
from pipesgd_lab.emulate import Cluster, parse_rate
from pipesgd_lab.emulate.netns import DEFAULT_MTU

from .runner import CellFailed

GROUP_OWNED = tuple(f"trainer.live.{k}" for k in ("lighthouse", "run_id", "replica", "replicas", "host"))
"""Keys the torchrun launcher sets on every group; an override of one is refused."""
# trainer.live.<key> -> the lighthouse's option: the lighthouse runs on its own under torchrun, and a
# group refuses these keys (pipesgd.live.launch.group_env); min_replicas goes to both
LIGHTHOUSE_OPTIONS = {f"trainer.live.{k}": option for k, (_, option) in LIGHTHOUSE_KEYS.items()}
LIGHTHOUSE_OPTIONS["trainer.live.min_replicas"] = "--min-replicas"
ADDRESS_TIMEOUT_S = 120.0


def check(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """``parser.error`` naming the option where ``--launcher torchrun`` cannot run: an override of a
    key it sets itself, a bad ``--rate``, or no root (network namespaces; not needed on ``loopback``)."""
    owned = [o for o in a.overrides if _key(o) in GROUP_OWNED]
    if owned:
        parser.error(f"override(s) {owned}: with --launcher torchrun the drill sets {', '.join(GROUP_OWNED)} itself")
    if a.rate == LOOPBACK:
        return
    try:
        parse_rate(a.rate)
    except ValueError as e:
        parser.error(f"argument --rate: {a.rate!r}: {e}")
    if os.geteuid() != 0 or shutil.which("ip") is None:
        parser.error("argument --launcher: torchrun runs the groups on emulated nodes (network namespaces, "
                     "`ip netns`): root only; use --launcher local")


def _key(override: str) -> str:
    """The dotted key an override sets, without Hydra's ``+``/``++``/``~`` prefix."""
    return override.split("=", 1)[0].lstrip("+~")


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """The lighthouse's options (from the ``trainer.live`` keys it owns) and the groups' overrides
    (without the keys a group under torchrun refuses)."""
    options, group = [], []
    for o in overrides:
        key, value = _key(o), o.split("=", 1)[1]
        if key in LIGHTHOUSE_OPTIONS:
            options += [LIGHTHOUSE_OPTIONS[key], value]
        if key not in LIGHTHOUSE_OPTIONS or key == "trainer.live.min_replicas":
            group.append(o)
    return options, group


START_KEY = "trainer.live.start_replicas"
"""The start barrier's key, which :func:`group_command` sets for every group."""


def group_command(train: Sequence[str], address: str, lighthouse: str, run_id: str, replica: int,
                  replicas: int, ranks: int = 1) -> list[str]:
    """Replica group ``replica``'s torchrun job: ``train`` (``pipesgd.train``'s arguments) told its run,
    in ``trainer.mode=live`` unless ``train`` names another mode of the live launcher (torchft_diloco).
    Every group waits for all ``replicas`` before its first step (``trainer.live.start_replicas``,
    unless ``train`` sets it): without that barrier a group that started late trained alone at first
    and a fault early in the run could fall before the other group had joined. ``ranks``: the
    group's processes (torchrun's ``--nproc-per-node``; more than 1 for ``trainer.mode=torchft_diloco``
    only, data parallel inside the group)."""
    barrier = [] if any(_key(t) == START_KEY for t in train) else [f"{START_KEY}={replicas}"]
    mode = [] if any(_key(t) == "trainer.mode" for t in train) else ["trainer.mode=live"]  # torchft_diloco's own
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            "--max-restarts", "1", "--monitor-interval", "0.5", "-m", "pipesgd.train", *train,
            *mode, f"trainer.live.lighthouse={lighthouse}", f"trainer.live.run_id={run_id}",
            f"trainer.live.replica={replica}", f"trainer.live.replicas={replicas}", f"trainer.live.host={address}",
            *barrier]


LOOPBACK = "loopback"
"""``rate`` for groups on this host's loopback (a curve of torchft's arms in groups of several ranks,
which the live launcher, one process per group, cannot start)."""


@contextlib.contextmanager
def _nodes(replicas: int, rate: str, mtu: int):
    """``node(r)``: (the command prefix that runs in node r, its address, its link's variables), on an
    emulated cluster of links ``rate``, or on this host's loopback for :data:`LOOPBACK`."""
    if rate == LOOPBACK:
        yield lambda r: ([], "127.0.0.1", {"GLOO_SOCKET_IFNAME": "lo"})
        return
    with Cluster(replicas, rate, handle_signals=False, mtu=mtu) as cluster:
        yield lambda r: (["ip", "netns", "exec", cluster.namespaces[r]], cluster.addresses[r],
                         {"GLOO_SOCKET_IFNAME": cluster.interfaces[r], "PIPESGD_EMULATED_LINK": cluster.rates[r]})


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                             "MASTER_ADDR", "MASTER_PORT", "PIPESGD_FAULT")}
    return env | {"OMP_NUM_THREADS": "1"} | extra


def _address(lighthouse: subprocess.Popen, log_path: Path) -> str:
    """The address the lighthouse prints once it listens (its first line)."""
    ready, _, _ = select.select([lighthouse.stdout], [], [], ADDRESS_TIMEOUT_S)
    line = lighthouse.stdout.readline().strip() if ready else ""
    if not line.startswith("http://"):
        raise CellFailed(f"the lighthouse printed no address ({line!r}); its log: {log_path}")
    return line


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_groups(train: Sequence[str], replicas: int, run_dir: Path, rate: str, fault: str | None,
               timeout_s: float, watch: Callable[[subprocess.Popen], None] | None = None,
               mtu: int = DEFAULT_MTU, ranks: int = 1) -> None:
    """Run the live job of ``replicas`` groups of ``ranks`` processes each (``train``:
    ``pipesgd.train``'s arguments, its ``hydra.run.dir`` ``run_dir`` included) on an emulated cluster
    of links ``rate`` (``loopback``: every group on this host's loopback, no namespaces), with
    ``PIPESGD_FAULT=fault`` for the last group; ``watch(proc)`` as in :func:`runner.run_logged`,
    given the last group's torchrun. Logs: ``<run_dir>.lighthouse.log`` and ``<run_dir>.node<r>.log``
    beside the run directory. Raises CellFailed if a group exits non-zero or the run outlasts
    ``timeout_s``."""
    options, train = split_overrides(train)
    logs = {r: run_dir.parent / f"{run_dir.name}.node{r}.log" for r in range(replicas)}
    lighthouse_log = run_dir.parent / f"{run_dir.name}.lighthouse.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    run_id = f"drill-{uuid.uuid4().hex[:8]}"
    deadline = time.monotonic() + timeout_s
    procs: list[subprocess.Popen] = []
    with _nodes(replicas, rate, mtu) as node:
        try:
            with lighthouse_log.open("w") as err:
                procs.append(subprocess.Popen(
                    [*node(0)[0], sys.executable, "-m", "pipesgd.live.lighthouse", "--host", node(0)[1], *options],
                    env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, text=True,
                    start_new_session=True))
            address = _address(procs[0], lighthouse_log)
            groups = []
            for r in range(replicas):
                prefix, host, link_env = node(r)
                env = _env(**link_env)
                if fault and r == replicas - 1:
                    env["PIPESGD_FAULT"] = fault  # the faulted group's first process only (faults.py)
                cmd = group_command(train, host, address, run_id, r, replicas, ranks)
                with logs[r].open("w") as out:
                    out.write(f"$ PIPESGD_FAULT={env.get('PIPESGD_FAULT', '')} {' '.join(cmd)}\n")
                    out.flush()
                    groups.append(subprocess.Popen([*prefix, *cmd], env=env,
                                                   stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                                   start_new_session=True))
                procs.append(groups[-1])
            if watch is not None:
                watch(groups[-1])
            for r, p in enumerate(groups):
                try:
                    code = p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise CellFailed(f"replica group {r} still running after {timeout_s:g} s; its log: {logs[r]}")
                if code != 0:
                    tail = " | ".join(logs[r].read_text(errors="replace").strip().splitlines()[-3:])
                    raise CellFailed(f"replica group {r}'s torchrun exited with status {code}; log {logs[r]}: {tail}")
        finally:
            _stop(procs)
