"""`SlurmCluster`: a real SLURM (munged, slurmctld, slurmd) on the emulated cluster (root only).

Read this file as the recipe; `python -m pipesgd_lab.emulate.slurm` runs it (`main`). Each host is an
emulated one (namespace, address on the shaped bridge, own hostname, /etc/hosts naming all)::

    login  10.213.X.1   munged, slurmctld; sbatch, srun, sinfo, squeue and scancel run here
    node1  10.213.X.2   slurmd (NodeName=node1 NodeHostname=node1 NodeAddr=10.213.X.2) ...

munged's socket is a file, so one serves every namespace. One state directory holds slurm.conf,
the munge key, the controller's state, the spools and the logs. Teardown on every exit path:
daemons get SIGTERM, what is left in the namespaces (jobs) dies with them, the state directory
and hosts files are removed. docs/multi-node.md, "SLURM", has the details and what is tested.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

from pipesgd_lab.emulate.cluster import Cluster, Interrupted, exit_status
from pipesgd_lab.emulate.netns import EX_UNAVAILABLE, EmulateError, EmulateUnavailable, preflight

log = logging.getLogger(__name__)

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "sinfo", "squeue", "scancel", "scontrol")
LOGIN = "login"


def missing_binaries() -> list[str]:
    """The SLURM and munge programs this machine lacks (empty when SlurmCluster can run)."""
    return [b for b in (*DAEMONS, *CLIENTS) if shutil.which(b, path=_SBIN_PATH) is None]


_SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _which(name: str) -> str:
    found = shutil.which(name, path=_SBIN_PATH)
    if found is None:
        raise EmulateUnavailable(
            f"'{name}' not found: install SLURM and munge (Debian: apt-get install slurm-wlm munge; "
            "`make setup` does it as root)",
            EX_UNAVAILABLE,
        )
    return found


def slurm_conf(
    *,
    cluster_name: str,
    state: Path,
    controller_addr: str,
    nodes: Mapping[str, str],
    cpus: int,
    memory_mb: int,
    kill_wait_s: int,
) -> str:
    """A minimal slurm.conf: root runs everything, no cgroups, no accounting database.

    `nodes` maps node names to addresses. Every node declares `cpus` CPUs and `memory_mb`: the
    emulated nodes share this machine's, so `SlurmdParameters=config_overrides` lets slurmd accept
    the declared numbers instead of draining a node whose hardware "does not match".
    """
    node_lines = [
        f"NodeName={name} NodeHostname={name} NodeAddr={addr} CPUs={cpus} RealMemory={memory_mb} "
        "State=UNKNOWN"
        for name, addr in nodes.items()
    ]
    return "\n".join([
        f"ClusterName={cluster_name}",
        f"SlurmctldHost={LOGIN}({controller_addr})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={state / 'munge' / 'munge.socket'}",
        f"StateSaveLocation={state / 'ctld'}",
        f"SlurmctldPidFile={state / 'slurmctld.pid'}",
        f"SlurmctldLogFile={state / 'logs' / 'slurmctld.log'}",
        f"SlurmdSpoolDir={state / 'spool' / '%n'}",
        f"SlurmdPidFile={state / 'slurmd-%n.pid'}",
        f"SlurmdLogFile={state / 'logs' / 'slurmd-%n.log'}",
        f"PlugStackConfig={state / 'plugstack.conf'}",
        "SlurmdParameters=config_overrides",
        # Linux process tree instead of cgroups: no cgroup hierarchy to set up or leave behind.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "ReturnToService=2",
        "MailProg=/bin/true",
        # SIGTERM, then SIGKILL this many seconds later: on scancel and at the time limit.
        f"KillWait={kill_wait_s}",
        "OverTimeLimit=0",
        # Finished jobs stay visible to scontrol/squeue (state, exit code) for 10 minutes.
        "MinJobAge=600",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=60",
        "MessageTimeout=30",
        *node_lines,
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


def hosts_file(names: Mapping[str, str]) -> str:
    lines = ["127.0.0.1 localhost", *(f"{addr} {name}" for name, addr in names.items()), ""]
    return "\n".join(lines)


class SlurmCluster:
    """A SLURM controller and `nodes` slurmd daemons, each on its own emulated host.

        with SlurmCluster(nodes=2, rate="1gbit", log_dir="logs") as slurm:
            slurm.run(["sbatch", "--wait", "job.sh"])      # in the login namespace, SLURM_CONF set

    `cpus_per_node`: CPUs each node declares (default: this machine's count; the nodes share them).
    `kill_wait_s`: SLURM's KillWait, the grace between SIGTERM and SIGKILL at scancel or time-out.
    `log_dir`: copy the daemons' logs there on exit (the state directory itself is removed).
    """

    def __init__(
        self,
        nodes: int = 2,
        rate: str = "1gbit",
        *,
        cpus_per_node: int | None = None,
        kill_wait_s: int = 10,
        log_dir: str | Path | None = None,
        ready_timeout_s: float = 60.0,
        handle_signals: bool = True,
    ) -> None:
        if not 1 <= nodes <= 253:
            raise ValueError(f"nodes={nodes} must be in [1, 253] (one /24 with the login host)")
        if kill_wait_s < 0:
            raise ValueError(f"kill_wait_s={kill_wait_s} must be >= 0")
        self.node_names = [f"node{i + 1}" for i in range(nodes)]
        self.cpus_per_node = cpus_per_node or os.cpu_count() or 1
        self.kill_wait_s = kill_wait_s
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.ready_timeout_s = ready_timeout_s
        self.cluster = Cluster(nodes + 1, rate, handle_signals=handle_signals)
        self.state: Path | None = None
        self.conf: Path | None = None
        self._stack: contextlib.ExitStack | None = None
        self._daemons: list[tuple[str, subprocess.Popen[bytes]]] = []

    # ---- where things are ----------------------------------------------------------------------

    @property
    def login_namespace(self) -> str:
        return self.cluster.namespaces[0]

    @property
    def node_namespaces(self) -> dict[str, str]:
        return dict(zip(self.node_names, self.cluster.namespaces[1:], strict=True))

    @property
    def node_addresses(self) -> dict[str, str]:
        return dict(zip(self.node_names, self.cluster.addresses[1:], strict=True))

    @property
    def daemon_pids(self) -> dict[str, int]:
        """'munged', 'slurmctld', 'slurmd node1', ... -> pid (of the namespace wrapper's process)."""
        return {label: proc.pid for label, proc in self._daemons}

    def env(self) -> dict[str, str]:
        """What a SLURM client needs besides running in the login namespace."""
        if self.conf is None:
            raise EmulateError("env() needs an entered SlurmCluster")
        return {"SLURM_CONF": str(self.conf)}

    def command(self, args: Sequence[str]) -> list[str]:
        """`args` as run on the login host: its namespace and its hostname."""
        return ["ip", "netns", "exec", self.login_namespace, *_with_hostname(LOGIN, args)]

    def run(self, args: Sequence[str], *, env: Mapping[str, str] | None = None,
            **kwargs: object) -> subprocess.CompletedProcess[str]:
        """subprocess.run(args) on the login host with SLURM_CONF set; text output captured.
        `env` replaces os.environ (as in subprocess); sbatch hands it on to the job."""
        full_env = {**(os.environ if env is None else env), **self.env()}
        kwargs.setdefault("capture_output", True)
        return subprocess.run(self.command(args), env=full_env, text=True, **kwargs)  # type: ignore[call-overload]

    # ---- lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        preflight()
        paths = {name: _which(name) for name in (*DAEMONS, *CLIENTS)}
        self._stack = contextlib.ExitStack()
        try:
            self._stack.enter_context(self.cluster)
            self._build(paths)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.__exit__(exc_type, exc, tb)

    def close(self) -> None:
        """Stop the daemons, kill every job, remove the state directory and the namespaces."""
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()

    def _build(self, paths: Mapping[str, str]) -> None:
        assert self._stack is not None
        started = time.perf_counter()
        self.state = Path(tempfile.mkdtemp(prefix=f"{self.cluster.prefix}-slurm-"))
        self._stack.callback(shutil.rmtree, self.state, ignore_errors=True)
        self._stack.callback(self._save_logs)
        self.state.chmod(0o711)  # munged wants every directory above its socket searchable
        for sub in ("munge", "ctld", "logs"):
            (self.state / sub).mkdir(mode=0o700)
        (self.state / "munge").chmod(0o711)
        for name in self.node_names:  # job scripts are executed from a node's spool: 0755
            (self.state / "spool" / name).mkdir(mode=0o755, parents=True)
        names = {LOGIN: self.cluster.addresses[0], **self.node_addresses}
        for ns in self.cluster.namespaces:
            self._add_hosts_file(ns, hosts_file(names))

        key = self.state / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        munge = self.state / "munge"
        self._daemon("munged", (LOGIN, self.login_namespace), [
            paths["munged"], "--foreground", "--force", f"--socket={munge / 'munge.socket'}",
            f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}",
            f"--seed-file={munge / 'munged.seed'}", f"--log-file={self.state / 'logs' / 'munged.log'}",
        ])  # fmt: skip
        _wait_for(lambda: (munge / "munge.socket").exists(), 20.0, "munged's socket",
                  self._daemons[-1][1])

        self.conf = self.state / "slurm.conf"
        self.conf.write_text(slurm_conf(
            cluster_name=self.cluster.prefix, state=self.state,
            controller_addr=self.cluster.addresses[0], nodes=self.node_addresses,
            cpus=self.cpus_per_node, memory_mb=_memory_mb(), kill_wait_s=self.kill_wait_s,
        ))  # fmt: skip
        (self.state / "plugstack.conf").write_text("")
        (self.state / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        self._daemon("slurmctld", (LOGIN, self.login_namespace),
                     [paths["slurmctld"], "-D", "-i", "-f", str(self.conf)])
        for name, ns in self.node_namespaces.items():
            # slurmd 22.05 initializes its cgroup plugin even with proctrack/linuxproc and
            # task/none, and `ip netns exec` mounts a fresh /sys without /sys/fs/cgroup: an empty
            # tmpfs there (in the daemon's private mount namespace) makes it pick cgroup/v1 and
            # never touch a real hierarchy.
            self._daemon(f"slurmd {name}", (name, ns),
                         ["sh", "-c", 'mount -t tmpfs pipesgd-no-cgroups /sys/fs/cgroup && exec "$@"',
                          "slurmd", paths["slurmd"], "-D", "-N", name, "-f", str(self.conf)])
        self._wait_idle()
        log.info("SLURM up in %.1fs: controller %s (%s), nodes %s; SLURM_CONF=%s",
                 time.perf_counter() - started, LOGIN, self.cluster.addresses[0],
                 ", ".join(f"{n} ({a})" for n, a in self.node_addresses.items()), self.conf)

    def _add_hosts_file(self, ns: str, text: str) -> None:
        # `ip netns exec NS` bind-mounts /etc/netns/NS/hosts over /etc/hosts for what it runs.
        assert self._stack is not None
        parent = Path("/etc/netns")
        if not parent.exists():
            parent.mkdir(exist_ok=True)  # another cluster may be creating it too
            self._stack.callback(_rmdir_if_empty, parent)
        folder = parent / ns
        folder.mkdir()
        self._stack.callback(shutil.rmtree, folder, ignore_errors=True)
        (folder / "hosts").write_text(text)

    def _daemon(self, label: str, host: tuple[str, str], cmd: list[str]) -> None:
        """Start `cmd` in the foreground on `host` = (hostname, namespace)."""
        assert self._stack is not None and self.state is not None
        cmd = ["ip", "netns", "exec", host[1], *_with_hostname(host[0], cmd)]
        out = open(self.state / "logs" / f"{label.replace(' ', '-')}.out", "wb")  # noqa: SIM115
        self._stack.callback(out.close)
        log.debug("$ %s", shlex.join(cmd))
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self._daemons.append((label, proc))
        self._stack.callback(_stop, label, proc, 10.0)

    def _wait_idle(self) -> None:
        """Until `sinfo` shows every node idle; raise naming the nodes that are not, and why."""
        deadline = time.monotonic() + self.ready_timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for label, proc in self._daemons:
                if proc.poll() is not None:
                    raise EmulateError(f"{label} exited with status {exit_status(proc.returncode)} "
                                       f"while starting; see {self._log_hint()}")
            done = self.run(["sinfo", "--noheader", "--Node", "--format=%N %T"], timeout=30)
            states = dict(line.split()[:2] for line in done.stdout.splitlines() if line.strip())
            if done.returncode == 0 and all(states.get(n) == "idle" for n in self.node_names):
                return
            time.sleep(0.5)  # polling a daemon we do not control; nothing to wait on instead
        reasons = self.run(["sinfo", "--noheader", "--list-reasons"], timeout=30).stdout.strip()
        raise EmulateError(f"SLURM nodes not idle after {self.ready_timeout_s:g}s: {states or 'no answer'}"
                           f"{'; reasons: ' + reasons if reasons else ''}; see {self._log_hint()}")

    def _log_hint(self) -> str:
        return str(self.log_dir if self.log_dir is not None else self.state / "logs")

    def _save_logs(self) -> None:
        if self.log_dir is None or self.state is None:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for f in (self.state / "logs").iterdir():
            with contextlib.suppress(OSError):
                shutil.copy(f, self.log_dir / f.name)
        if self.conf is not None and self.conf.exists():
            shutil.copy(self.conf, self.log_dir / "slurm.conf")


def _with_hostname(hostname: str, cmd: Sequence[str]) -> list[str]:
    """`cmd` in a new UTS namespace whose hostname is `hostname` (what `hostname` says in a job)."""
    return ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname, *cmd]


def _wait_for(ready: Callable[[], bool], timeout_s: float, what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None:
            raise EmulateError(f"{what}: the daemon exited with status {exit_status(proc.returncode)}")
        if time.monotonic() > deadline:
            raise EmulateError(f"{what} did not appear within {timeout_s:g}s")
        time.sleep(0.05)


def _stop(label: str, proc: subprocess.Popen[bytes], grace_s: float) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning("%s ignored SIGTERM for %gs: SIGKILL", label, grace_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _rmdir_if_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):  # another cluster's hosts file may live there now
        folder.rmdir()


def _memory_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pipesgd_lab.emulate.slurm [options] [-- COMMAND ...]`: start SLURM on an emulated
    cluster, run COMMAND on its login host (default: an interactive shell) with SLURM_CONF set,
    tear everything down, and exit with COMMAND's status (77 not root, 69 programs missing)."""
    parser = argparse.ArgumentParser(prog="python -m pipesgd_lab.emulate.slurm", description=main.__doc__)
    parser.add_argument("--nodes", type=int, default=2, help="slurmd nodes (default 2)")
    parser.add_argument("--rate", default="1gbit", help="every link's rate, both directions (default 1gbit)")
    parser.add_argument("--cpus-per-node", type=int, default=None, help="CPUs each node declares")
    parser.add_argument("--kill-wait-s", type=int, default=10, help="SLURM KillWait (default 10)")
    parser.add_argument("--log-dir", default=None, help="keep the daemons' logs and slurm.conf here")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every ip/tc/daemon command")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="after --: what to run on the login host")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        with SlurmCluster(args.nodes, args.rate, cpus_per_node=args.cpus_per_node,
                          kill_wait_s=args.kill_wait_s, log_dir=args.log_dir) as slurm:
            log.info("login host: %s; nodes: %s", slurm.login_namespace,
                     ", ".join(f"{n} in {ns}" for n, ns in slurm.node_namespaces.items()))
            done = slurm.run(command or [os.environ.get("SHELL", "/bin/bash"), "-i"], capture_output=False)
            return exit_status(done.returncode)
    except EmulateUnavailable as e:
        log.error("%s", e)
        return e.exit_code
    except Interrupted as e:
        return 128 + e.signum
    except EmulateError as e:
        log.error("%s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
