"""`Cluster`: N network namespaces on one bridge, every link shaped with tc tbf, one process each.

Topology (the bridge lives in its own namespace, so the host's interfaces are never touched)::

    <prefix>-0: veth0 10.213.X.1 ──┐            ┌── <prefix>-br: br0 ── port0, port1, ...
    <prefix>-1: veth1 10.213.X.2 ──┼── veth ────┘
    ...                             (tbf on vethI: worker -> bridge; tbf on portI: bridge -> worker)

With a one-way delay (`delay_s > 0`) the veths and the bridge are replaced by a TUN device per
namespace and a userspace relay process (relay.py) that forwards each packet after the delay: the
kernel here has no sch_netem, and this is the one honest way found to add latency (see
docs/emulated-cluster.md for its cost). Rates stay tbf in the kernel on the uplink.

Teardown is a LIFO registry (ExitStack) filled as things are created, so a failure halfway through
setup removes exactly what exists. Worker processes run in their own process group; on teardown
each group gets SIGTERM, then SIGKILL after a grace period, and anything still inside one of our
namespaces is killed before the namespace is deleted (deleting a namespace removes its veth ends
and the bridge with it).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import TextIO

from pipesgd_lab.emulate import relay
from pipesgd_lab.emulate.netns import (
    DEFAULT_BURST_S,
    DEFAULT_MTU,
    DEFAULT_QUEUE_S,
    MAX_MTU,
    MIN_MTU,
    EmulateError,
    Shaping,
    format_rate,
    list_namespaces,
    namespace_pids,
    parse_rate,
    pick_subnet,
    preflight,
    sh,
)

log = logging.getLogger(__name__)

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_instances = itertools.count()
EXIT_TIMEOUT = 124  # as timeout(1)


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread when SIGINT/SIGTERM/SIGHUP arrives while a Cluster is up."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_status(returncode: int) -> int:
    """Popen returncode -> shell-style status (killed by signal S -> 128 + S)."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen[bytes]
    reader: threading.Thread


class Cluster:
    """An emulated cluster of `workers` hosts, each link shaped to its rate in both directions.

    Use as a context manager; entering creates everything (root only), leaving removes everything,
    also on exceptions and on SIGINT/SIGTERM/SIGHUP (turned into `Interrupted` while the cluster is
    up, when entered from the main thread).

        with Cluster(2, "100mbit") as c:
            code = c.run(lambda rank: [sys.executable, "-m", "pipesgd.train", ...])

    `rates`: one rate for all links or one per worker ('100mbit', '1gbit', ... or bit/s as int).
    `burst_s`/`queue_s`: tbf bucket depth and queue length, in seconds of the link's rate.
    `delay_s`: one-way delay added between any two hosts (round trip +2x), through the TUN relay.
    `mtu`: every interface's MTU (default 9000, jumbo frames; 1500 is the earlier link).
    `ranks_per_host`: k ranks on each host (global rank = host * k + local rank), as torchrun's
    `--nproc-per-node k`: ranks of one host talk over its loopback, only traffic between hosts
    crosses a shaped link. `run()` starts `workers * k` ranks.
    `output`: where the workers' merged stdout/stderr goes, one line at a time, prefixed
    '[rank i] ' (rank 0 unprefixed unless `prefix_rank0`).
    """

    def __init__(
        self,
        workers: int,
        rates: str | int | Sequence[str | int],
        *,
        burst_s: float = DEFAULT_BURST_S,
        queue_s: float = DEFAULT_QUEUE_S,
        delay_s: float = 0.0,
        mtu: int = DEFAULT_MTU,
        ranks_per_host: int = 1,
        output: TextIO | None = None,
        prefix_rank0: bool = False,
        grace_s: float = 5.0,
        handle_signals: bool = True,
    ) -> None:
        if not 1 <= workers <= 254:
            raise ValueError(f"workers={workers} must be in [1, 254] (one /24 subnet)")
        rate_list = [rates] * workers if isinstance(rates, (str, int)) else list(rates)
        if len(rate_list) != workers:
            raise ValueError(
                f"rates has {len(rate_list)} entries ({rate_list}) but workers={workers}; "
                "give one rate, or one per worker"
            )
        if burst_s <= 0 or queue_s <= 0:
            raise ValueError(f"burst_s={burst_s} and queue_s={queue_s} must be > 0")
        if not 0 <= delay_s <= 10:
            raise ValueError(f"delay_s={delay_s} must be in [0, 10] seconds")
        if isinstance(mtu, bool) or not isinstance(mtu, int) or not MIN_MTU <= mtu <= MAX_MTU:
            raise ValueError(f"mtu={mtu!r} must be an integer in [{MIN_MTU}, {MAX_MTU}] bytes")
        if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, int) or ranks_per_host < 1:
            raise ValueError(f"ranks_per_host={ranks_per_host!r} must be an integer >= 1")
        self.mtu = mtu
        self.workers = workers
        self.ranks_per_host = ranks_per_host
        self.shaping = [Shaping.for_rate(parse_rate(r), burst_s, queue_s) for r in rate_list]
        n = next(_instances)
        self.prefix = f"psgd{os.getpid()}" + (f"x{n}" if n else "")
        self.delay_s = delay_s
        self.bridge_namespace = None if delay_s else f"{self.prefix}-br"
        self.namespaces = [f"{self.prefix}-{i}" for i in range(workers)]
        self.interfaces = [f"{'tun' if delay_s else 'veth'}{i}" for i in range(workers)]
        self.addresses: list[str] = []
        self._output = output
        self._prefix_rank0 = prefix_rank0
        self._grace_s = grace_s
        self._handle_signals = handle_signals
        self._stack: contextlib.ExitStack | None = None
        self._previous_handlers: dict[int, object] = {}
        self._closing = False
        self._pending_signal: int | None = None
        self._write_lock = threading.Lock()
        self._relay: subprocess.Popen[bytes] | None = None
        self._up = False

    def _all_namespaces(self) -> set[str]:
        return {*self.namespaces, *([self.bridge_namespace] if self.bridge_namespace else [])}

    @property
    def rates(self) -> list[str]:
        return [format_rate(s.rate_bps) for s in self.shaping]

    @property
    def world(self) -> int:
        """Ranks in all: `workers` hosts of `ranks_per_host` each."""
        return self.workers * self.ranks_per_host

    def host_of(self, rank: int) -> int:
        """The host (namespace index) global `rank` runs on."""
        return rank // self.ranks_per_host

    # ---- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        preflight()
        taken = set(list_namespaces()) & self._all_namespaces()
        if taken:
            raise EmulateError(f"namespaces {sorted(taken)} already exist; refusing to reuse them")
        self._stack = contextlib.ExitStack()
        self._closing = False
        self._install_signal_handlers()
        try:
            started = time.perf_counter()
            self._build()
            self._up = True
            log.info(
                "emulated cluster up in %.2fs: %d workers (x%d ranks) on %s.0/24, links %s (tbf burst %s B)%s",
                time.perf_counter() - started,
                self.workers,
                self.ranks_per_host,
                self.subnet,
                ",".join(self.rates),
                ",".join(str(s.burst_bytes) for s in self.shaping),
                f", one-way delay {self.delay_s * 1e3:g} ms (TUN relay)" if self.delay_s else "",
            )
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        pending = self.close()
        if pending is not None and exc_type is None:
            raise Interrupted(pending)

    def close(self) -> int | None:
        """Tear down everything created so far; idempotent. Returns a signal that arrived meanwhile."""
        self._closing = True
        self._up = False
        try:
            if self._stack is not None:
                self._stack.close()
                self._stack = None
            left = set(list_namespaces()) & self._all_namespaces()
            if left:
                log.error("namespaces left behind after teardown: %s", sorted(left))
        finally:
            self._restore_signal_handlers()
        pending, self._pending_signal = self._pending_signal, None
        return pending

    def _build(self) -> None:
        self.addresses = []
        self.subnet = pick_subnet(os.getpid())
        if self.delay_s:
            self._build_tun()
            return
        br = self.bridge_namespace
        assert br is not None
        self._add_namespace(br)
        sh(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
        sh(["ip", "-n", br, "link", "set", "br0", "mtu", str(self.mtu), "up"])
        for i, (ns, ifname, shaping) in enumerate(
            zip(self.namespaces, self.interfaces, self.shaping, strict=True)
        ):
            self._add_namespace(ns)
            port = f"port{i}"
            address = f"{self.subnet}.{i + 1}"
            # Created directly inside the two namespaces: the host never sees either end.
            sh(["ip", "-n", br, "link", "add", port, "type", "veth", "peer", "name", ifname,
                "netns", ns])  # fmt: skip
            sh(["ip", "-n", br, "link", "set", port, "master", "br0"])
            sh(["ip", "-n", br, "link", "set", port, "mtu", str(self.mtu), "up"])
            sh(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", ifname])
            sh(["ip", "-n", ns, "link", "set", ifname, "mtu", str(self.mtu), "up"])
            # Both directions: worker -> bridge on the worker's end, bridge -> worker on the port.
            sh(["tc", "-n", ns, "qdisc", "add", "dev", ifname, "root", *shaping.tc_args()])
            sh(["tc", "-n", br, "qdisc", "add", "dev", port, "root", *shaping.tc_args()])
            self.addresses.append(address)

    def _build_tun(self) -> None:
        for i, (ns, ifname, shaping) in enumerate(
            zip(self.namespaces, self.interfaces, self.shaping, strict=True)
        ):
            self._add_namespace(ns)
            address = f"{self.subnet}.{i + 1}"
            # Persistent, so it exists before the relay attaches and dies with the namespace.
            sh(["ip", "-n", ns, "tuntap", "add", "dev", ifname, "mode", "tun"])
            sh(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", ifname])
            sh(["ip", "-n", ns, "link", "set", ifname, "mtu", str(self.mtu), "up"])
            sh(["tc", "-n", ns, "qdisc", "add", "dev", ifname, "root", *shaping.tc_args()])
            self.addresses.append(address)
        links = [
            f"{ns}:{ifname}:{address}:{shaping.rate_bps}"
            for ns, ifname, address, shaping in zip(
                self.namespaces, self.interfaces, self.addresses, self.shaping, strict=True
            )
        ]
        cmd = [sys.executable, relay.__file__, "--delay-s", str(self.delay_s),
               "--queue-s", str(self.shaping[0].queue_s), *links]  # fmt: skip
        log.debug("$ %s", " ".join(cmd))
        self._relay = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True
        )
        assert self._stack is not None
        self._stack.callback(self._stop_relay)
        assert self._relay.stdout is not None
        ready, _, _ = select.select([self._relay.stdout], [], [], 30.0)
        line = self._relay.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            raise EmulateError(f"the delay relay did not start (exit status {self._relay.poll()})")

    def _stop_relay(self) -> None:
        if self._relay is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._relay.pid, signal.SIGTERM)
        try:
            self._relay.wait(timeout=self._grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._relay.pid, signal.SIGKILL)
            self._relay.wait()
        if self._relay.stdout is not None:
            self._relay.stdout.close()
        self._relay = None

    def _add_namespace(self, ns: str) -> None:
        assert self._stack is not None
        sh(["ip", "netns", "add", ns])
        self._stack.callback(self._delete_namespace, ns)
        sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        if shutil.which("sysctl"):
            # No IPv6 link-local addresses: Gloo picks the first address of GLOO_SOCKET_IFNAME,
            # and router/neighbour solicitations would share the shaped link.
            sh(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                "net.ipv6.conf.default.disable_ipv6=1"], check=False)  # fmt: skip

    def _delete_namespace(self, ns: str) -> None:
        for pid in namespace_pids(ns):
            log.warning("killing pid %d left inside namespace %s", pid, ns)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        done = sh(["ip", "netns", "del", ns], check=False)
        if done.returncode != 0:
            log.error("could not delete namespace %s: %s", ns, done.stderr.strip())

    # ---- signals -----------------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        if not self._handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for signum in _SIGNALS:
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._closing:
            # Finish tearing down first; __exit__ re-raises it.
            self._pending_signal = signum
            return
        log.warning("%s received: tearing the emulated cluster down", signal.Signals(signum).name)
        self._closing = True  # a second Ctrl-C must not cut the teardown short
        raise Interrupted(signum)

    # ---- workers -----------------------------------------------------------------------------

    def rank_env(self, rank: int, master_port: int = 29500) -> dict[str, str]:
        """The torchrun environment contract for global `rank` (as torchrun's `--nproc-per-node
        ranks_per_host` on each host: GROUP_* count hosts), plus Gloo's interface and the link rate
        of its host."""
        if not self._up:
            raise EmulateError("rank_env() needs an entered Cluster")
        if not 0 <= rank < self.world:
            raise ValueError(f"rank={rank} must be in [0, {self.world})")
        host, k = self.host_of(rank), self.ranks_per_host
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world),
            "LOCAL_RANK": str(rank - host * k),
            "LOCAL_WORLD_SIZE": str(k),
            "GROUP_RANK": str(host),
            "GROUP_WORLD_SIZE": str(self.workers),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(self.world),
            "MASTER_ADDR": self.addresses[0],
            "MASTER_PORT": str(master_port),
            "GLOO_SOCKET_IFNAME": self.interfaces[host],
            "PIPESGD_EMULATED_LINK": self.rates[host],
        }

    def run(
        self,
        cmd_for_rank: Callable[[int], list[str]],
        env: Mapping[str, str] | None = None,
        *,
        master_port: int = 29500,
        timeout_s: float | None = None,
        keep_going: bool = False,
        cwd: str | None = None,
    ) -> int:
        """Run `cmd_for_rank(i)` for every global rank i in its host's namespace and wait; return a
        shell-style status.

        Environment: os.environ, then `rank_env(i)`, then `env` (wins). OMP_NUM_THREADS defaults to
        cpu_count // world (as torchrun does for several local workers: every rank shares the CPUs).
        0 when every rank exits 0. Otherwise the first failing rank's status (128 + signal if it
        was killed); the other ranks are then terminated unless `keep_going`. `timeout_s`:
        terminate everything after that long and return 124.
        """
        if not self._up:
            raise EmulateError("run() needs an entered Cluster")
        exits: queue.Queue[tuple[int, int]] = queue.Queue()
        running: list[_Worker] = []
        try:
            for rank in range(self.world):
                full_env = dict(os.environ)
                full_env.setdefault(
                    "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.world))
                )
                full_env |= self.rank_env(rank, master_port) | dict(env or {})
                running.append(self._start(rank, cmd_for_rank(rank), full_env, cwd, exits))
            return self._wait(exits, timeout_s, keep_going)
        finally:
            self._stop(running)

    def _start(
        self,
        rank: int,
        cmd: list[str],
        env: dict[str, str],
        cwd: str | None,
        exits: queue.Queue[tuple[int, int]],
    ) -> _Worker:
        ns = self.namespaces[self.host_of(rank)]
        log.info("rank %d in %s (%s): %s", rank, ns, self.addresses[self.host_of(rank)], " ".join(cmd))
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, *cmd],
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: terminal signals reach us, not them
        )
        prefix = f"[rank {rank}] " if rank or self._prefix_rank0 else ""
        reader = threading.Thread(
            target=self._forward, args=(proc, prefix), name=f"emulate-out-{rank}", daemon=True
        )
        reader.start()
        threading.Thread(
            target=lambda: exits.put((rank, proc.wait())), name=f"emulate-wait-{rank}", daemon=True
        ).start()
        return _Worker(rank, proc, reader)

    def _forward(self, proc: subprocess.Popen[bytes], prefix: str) -> None:
        assert proc.stdout is not None
        out = self._output or sys.stdout
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace")
            with self._write_lock, contextlib.suppress(ValueError, OSError):
                out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
                out.flush()
        proc.stdout.close()

    def _wait(
        self, exits: queue.Queue[tuple[int, int]], timeout_s: float | None, keep_going: bool
    ) -> int:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        remaining = set(range(self.world))
        first_failure: int | None = None
        while remaining:
            try:
                rank, code = exits.get(timeout=0.2)
            except queue.Empty:
                if self._relay is not None and self._relay.poll() is not None:
                    log.error("the delay relay exited (%s): the network is gone", self._relay.poll())
                    return first_failure or 1
                if deadline is not None and time.monotonic() > deadline:
                    log.error("timeout after %ss: terminating ranks %s", timeout_s, sorted(remaining))
                    return first_failure or EXIT_TIMEOUT
                continue
            remaining.discard(rank)
            if code == 0:
                log.info("rank %d finished", rank)
                continue
            log.error("rank %d failed with exit status %d", rank, exit_status(code))
            if first_failure is None:
                first_failure = exit_status(code)
            if not keep_going:
                if remaining:
                    log.error("terminating the other ranks %s", sorted(remaining))
                return first_failure
        return first_failure or 0

    def _stop(self, workers: list[_Worker]) -> None:
        """SIGTERM each worker's process group, SIGKILL after the grace period, reap, drain output."""
        alive = [w for w in workers if w.proc.poll() is None]
        for w in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self._grace_s
        for w in alive:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank %d ignored SIGTERM for %ss: SIGKILL", w.rank, self._grace_s)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(w.proc.pid, signal.SIGKILL)
                w.proc.wait()
        # Anything still inside a worker namespace was started by this run (e.g. a daemon that
        # left the process group): nothing else lives there.
        for w in workers:
            for pid in namespace_pids(self.namespaces[self.host_of(w.rank)]):
                log.warning("killing pid %d left behind by rank %d", pid, w.rank)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for w in workers:
            w.reader.join(timeout=2.0)


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces named by a Cluster whose creating process no longer exists.

    Only needed after the emulate process itself was SIGKILLed (nothing can clean up then).
    """
    removed = []
    for ns in list_namespaces():
        match = re.match(r"^psgd(\d+)(?:x\d+)?-(?:br|\d+)$", ns)
        if match is None or _pid_alive(int(match[1])):
            continue
        for pid in namespace_pids(ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if sh(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(ns)
        # Per-namespace files of `ip netns exec` (pipesgd_lab.emulate.slurm writes hosts files there).
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
