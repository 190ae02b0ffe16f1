"""`python -m pipesgd_lab.emulate [options] -- <Hydra overrides>`: train on an emulated cluster.

Every rank runs `<python> -m <module> <overrides> hydra.run.dir=<DIR>` in its host's namespace with
the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...); `--ranks-per-replica k` puts k ranks
on each host and tells them `dist.ranks_per_replica=k`. DIR is chosen once, here, so all
ranks share one run directory; a `hydra.run.dir=...` among the overrides wins, with any `${now:...}`
in it resolved here for the same reason.

Exit status: 0; the first failing rank's status; 124 on --timeout-s; 77 not root; 69 ip/tc/netns
missing; 1 setup failure; killed by the signal that interrupted it (after teardown).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from pipesgd_lab.emulate.cluster import Cluster, Interrupted, remove_stale_namespaces
from pipesgd_lab.emulate.netns import (
    DEFAULT_BURST_S,
    DEFAULT_MTU,
    DEFAULT_QUEUE_S,
    EmulateError,
    EmulateUnavailable,
    parse_rate,
    preflight,
)

log = logging.getLogger("pipesgd_lab.emulate")

_RUN_DIR_RE = re.compile(r"^\+{0,2}hydra\.run\.dir=(.*)$")
_NOW_RE = re.compile(r"\$\{now:([^}]*)\}")
_RANKS_PER_REPLICA_RE = re.compile(r"^\+{0,2}dist\.ranks_per_replica=(.*)$")
REPLICA_KEY = "dist.ranks_per_replica"
"""The training config's key that makes k consecutive ranks one replica (a host here)."""


def replica_overrides(overrides: Sequence[str], ranks_per_replica: int) -> list[str]:
    """``overrides`` telling the ranks ``dist.ranks_per_replica=k`` (nothing added for k = 1, the
    library's default). ValueError naming ``--ranks-per-replica`` where an override already sets the
    key to another value: a replica would not be the emulated host."""
    given = [m[1] for o in overrides if (m := _RANKS_PER_REPLICA_RE.match(o))]
    if other := [g for g in given if g.strip() != str(ranks_per_replica)]:
        raise ValueError(f"--ranks-per-replica {ranks_per_replica} puts {ranks_per_replica} rank(s) on each emulated "
                         f"host and passes {REPLICA_KEY}={ranks_per_replica}, but the overrides set "
                         f"{REPLICA_KEY}={other[0]}: leave the key out or give the same value")
    if given or ranks_per_replica == 1:
        return list(overrides)
    return [*overrides, f"{REPLICA_KEY}={ranks_per_replica}"]


def resolve_run_dir(
    overrides: Sequence[str], now: time.struct_time, default_root: str = "outputs/emulate"
) -> tuple[list[str], str | None]:
    """Pin one run directory for all ranks. Returns (overrides to pass, the directory or None).

    None means the user's hydra.run.dir still holds an interpolation only Hydra can resolve
    (e.g. ${hydra.job.name}); it is passed through unchanged.
    """
    out = list(overrides)
    for i, override in enumerate(out):
        match = _RUN_DIR_RE.match(override)
        if match is None:
            continue
        value = _NOW_RE.sub(lambda m: time.strftime(m[1], now), match[1])
        out[i] = override[: len(override) - len(match[1])] + value
        return out, (None if "${" in value else value)
    run_dir = os.path.abspath(os.path.join(default_root, time.strftime("%Y-%m-%d_%H-%M-%S", now)))
    return [*out, f"hydra.run.dir={run_dir}"], run_dir


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipesgd_lab.emulate",
        description="Run pipesgd.train on N network namespaces joined by tbf-shaped veth links "
        "(root only). Everything after '--' is passed to every rank as Hydra overrides.",
    )
    p.add_argument("--workers", type=int, help="number of emulated hosts (--ranks-per-replica ranks each)")
    p.add_argument(
        "--ranks-per-replica", type=int, default=1, metavar="K",
        help="ranks on each emulated host, one replica (default 1): RANK = host*K + LOCAL_RANK, "
        f"traffic inside a host on its loopback; passes {REPLICA_KEY}=K to the ranks",
    )  # fmt: skip
    p.add_argument("--rate", help="rate of every link, both directions: 100mbit, 1gbit, ...")
    p.add_argument(
        "--rate-per-worker", help="comma-separated rate per worker, e.g. 100mbit,1gbit"
    )
    p.add_argument("--timeout-s", type=float, help="terminate all ranks after this many seconds")
    p.add_argument(
        "--keep-going",
        action="store_true",
        help="when a rank fails, let the others finish instead of terminating them",
    )
    p.add_argument("--module", default="pipesgd.train", help="module each rank runs with -m")
    p.add_argument("--python", default=sys.executable, help="interpreter for the ranks")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument(
        "--burst-ms", type=float, default=DEFAULT_BURST_S * 1000,
        help="tbf bucket depth as ms at the link rate (min 16 KiB)",
    )  # fmt: skip
    p.add_argument(
        "--queue-ms", type=float, default=DEFAULT_QUEUE_S * 1000,
        help="tbf queue length as ms at the link rate (tbf 'latency': max wait, not added delay)",
    )  # fmt: skip
    p.add_argument(
        "--mtu", type=int, default=DEFAULT_MTU,
        help=f"MTU of every emulated interface (default {DEFAULT_MTU}, jumbo frames, cheap per byte like a "
        "cluster NIC; 1500 is the earlier, CPU-hungry link)",
    )  # fmt: skip
    p.add_argument(
        "--delay-ms", type=float, default=0.0,
        help="one-way delay between any two hosts (round trip +2x). >0 replaces veth+bridge by "
        "TUN devices and a userspace relay (no sch_netem here); costs CPU, suits <= ~100mbit",
    )  # fmt: skip
    p.add_argument(
        "--cleanup", action="store_true",
        help="remove namespaces left by emulate runs that were SIGKILLed, then exit",
    )  # fmt: skip
    p.add_argument("-v", "--verbose", action="store_true", help="log every ip/tc command")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = _parser()
    args = parser.parse_args(argv[:split])
    if args.ranks_per_replica < 1:
        parser.error(f"argument --ranks-per-replica: must be an integer >= 1 (ranks on each emulated host), "
                     f"got {args.ranks_per_replica}")
    try:
        overrides = replica_overrides(argv[split + 1 :], args.ranks_per_replica)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s emulate: %(message)s",
        datefmt="%H:%M:%S",
    )

    try:
        preflight()
    except EmulateUnavailable as e:
        log.error("%s", e)
        return e.exit_code
    if args.cleanup:
        log.info("removed stale namespaces: %s", remove_stale_namespaces() or "none")
        return 0

    if args.workers is None:
        parser.error("--workers is required")
    if (args.rate is None) == (args.rate_per_worker is None):
        parser.error("give exactly one of --rate and --rate-per-worker")
    rates = [args.rate] if args.rate else args.rate_per_worker.split(",")
    try:
        for r in rates:
            parse_rate(r)
        cluster = Cluster(
            args.workers,
            rates[0] if args.rate else rates,
            burst_s=args.burst_ms / 1000,
            queue_s=args.queue_ms / 1000,
            delay_s=args.delay_ms / 1000,
            mtu=args.mtu,
            ranks_per_host=args.ranks_per_replica,
        )
    except ValueError as e:
        parser.error(str(e))

    overrides, run_dir = resolve_run_dir(overrides, time.localtime())
    cmd = [args.python, "-m", args.module, *overrides]
    log.info("run dir: %s", run_dir or "left to Hydra (hydra.run.dir has an interpolation)")
    try:
        with cluster:
            if run_dir is not None:
                _record(cluster, run_dir, cmd, args)
            return cluster.run(
                lambda rank: cmd,
                master_port=args.master_port,
                timeout_s=args.timeout_s,
                keep_going=args.keep_going,
            )
    except Interrupted as e:
        log.warning("interrupted by %s; emulated cluster removed", signal.Signals(e.signum).name)
        # Die of the same signal so the caller (a shell, make) sees why we stopped.
        signal.signal(e.signum, signal.SIG_DFL)
        os.kill(os.getpid(), e.signum)
        return 128 + e.signum
    except EmulateError as e:
        log.error("%s", e)
        return 1


def _record(cluster: Cluster, run_dir: str, cmd: list[str], args: argparse.Namespace) -> None:
    """emulate.json next to the run's own outputs: the link a result was measured on."""
    os.makedirs(run_dir, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    info = {
        "workers": cluster.workers,
        "ranks_per_host": cluster.ranks_per_host,
        "world_size": cluster.world,
        "rates": cluster.rates,
        "tbf": [s.tc_args() for s in cluster.shaping],
        "delay_ms": cluster.delay_s * 1000,
        "mtu": cluster.mtu,
        "namespaces": cluster.namespaces,
        "addresses": cluster.addresses,
        "command": cmd,
        "emulate_argv": sys.argv,
        "commit": commit or None,
        "timeout_s": args.timeout_s,
    }
    with open(os.path.join(run_dir, "emulate.json"), "w") as f:
        json.dump(info, f, indent=2)
