"""``python -m pipesgd_lab.bench.live_drill [options] [Hydra overrides]``: lose a replica group of a
live run (``trainer.mode=live``, torchft) and measure what it costs (docs/reliability.md, "Live
recovery", "The drill").

Per seed, the live job (``python -m pipesgd.train ... trainer.mode=live dist.nproc=R
dist.max_restarts=1 trainer.log_every=1``) runs on loopback with ``PIPESGD_FAULT`` set for its
last group, R-1:

* ``--fault kill``: the group SIGKILLs itself after step ``--at-step``; the launcher restarts it
  and it heals from a live peer;
* ``--fault stop``: the group SIGSTOPs itself there (a hang); ``--stop-s`` seconds later this tool
  sends it SIGCONT (``--after-stop cont``: the same process goes on, and heals where the others
  moved on without it) or SIGKILL (``--after-stop kill``: the launcher restarts it, as after
  ``kill``).

From the groups' logs (``<run>/replica_<r>/train.log``, a timestamped line per step) and summaries
it computes the survivors' stall (the longest gap between two of their steps from the fault until
the returning group trains again, less their median step before it), the updates their common
model lost (``live_skipped_commits`` of the survivors that never healed), the returning group's
time from its process start (or the SIGCONT) to its first step after healing, split where its
imports were done, whether every group ends with the same weights (``param_checksum``), and the
final accuracy against an uninterrupted live run of the same seed (``--reference``). Writes
``--json`` (with the overrides, commit and host fingerprint) and prints a table.

``--launcher local`` (the default) runs the groups under the local live launcher, on loopback.
``--launcher torchrun`` (root only) runs them on an emulated cluster of R nodes (``--rate``, default
1gbit): the lighthouse in node 0's namespace, each group its own torchrun job (``--max-restarts 1``)
on its own node, ``PIPESGD_FAULT`` set for group R-1's job only (:mod:`.live_drill_torchrun`); the
groups write the same ``replica_<r>`` logs and summaries, read by the same analysis, and the
cluster is torn down however the run ends. A returning torchrun worker takes its process's start
from the kernel (torchrun passes none on).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from pipesgd.observability.hostinfo import fingerprint
from pipesgd.launch import process_state
from pipesgd.live.launch import STARTED, replica_dir
from pipesgd.observability.runinfo import git_commit
from pipesgd_lab.emulate.drill import STEP, Log, stamp

from . import live_drill_torchrun
from .runner import (CellFailed, Stopped, check_seeds_and_overrides, recorded, run_logged, save,
                     stop_on_signals)

log = logging.getLogger("pipesgd_lab.bench.live_drill")
ROOT = Path()  # defaults are under the current directory (run from a clone's root)

WORKLOADS: dict[str, tuple[str, ...]] = {
    # the recipe at 4 epochs instead of 2, batch 64 per group (1875 steps with 2 groups, 1248 with 3):
    # at ~10 ms a step, long enough that a restarted group (process start, imports, data: seconds)
    # comes back while the others still train
    "mnist": ("+experiment=mnist_mlp", "trainer.epochs=4"),
    # the elastic study's short CIFAR recipe (elastic_study.WORKLOADS["cifar10"]): ResNet-20, 2 epochs,
    # batch 64 per group, lookahead (780 steps with 2 groups, 520 with 3)
    "cifar10": ("+experiment=resnet_cifar", "staleness=lookahead", "trainer.epochs=2", "data.batch_size=64"),
}
"""Workload -> its overrides. Spelled here only."""
OWNED = ("seed", "trainer.mode", "dist.nproc", "dist.max_restarts", "trainer.log_every", "hydra.run.dir")
"""Keys this tool sets on every run; an override of one is refused."""
_FAULT = re.compile(r"fault injection \(PIPESGD_FAULT\): replica group (\d+) \(pid (\d+)\) does '(\w+)' at step (\d+)")
_HEALED = "healed from a peer"
_DIGEST = re.compile(r"weights sha256 (\w+) after the update of step (\d+), the first since this replica (healed|served)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipesgd_lab.bench.live_drill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. data.root=PATH")
    p.add_argument("--workload", default="mnist", choices=sorted(WORKLOADS), help="the recipe (default mnist)")
    p.add_argument("--replicas", type=int, default=2, help="replica groups R (default 2); group R-1 is faulted")
    p.add_argument("--fault", default="kill", choices=("kill", "stop"), help="what group R-1 does (default kill)")
    p.add_argument("--at-step", type=int, default=100, help="the step after which it does it (default 100)")
    p.add_argument("--stop-s", type=float, default=3.0, help="seconds a stopped group stays stopped (default 3)")
    p.add_argument("--after-stop", default="cont", choices=("cont", "kill"),
                   help="the signal that ends a stop: SIGCONT or SIGKILL (default cont)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    p.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                   help="also run each seed uninterrupted, for the final accuracy (default on)")
    p.add_argument("--dir", type=Path, default=ROOT / "outputs" / "live_drill", help="run directories")
    p.add_argument("--json", type=Path, default=None, help="the result (default <dir>/live_drill.json)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run (default 1800)")
    p.add_argument("--launcher", default="local", choices=("local", "torchrun"),
                   help="local: the live launcher on loopback (default); torchrun: each group a torchrun job on "
                        "its own emulated node, the lighthouse on node 0 (root only)")
    p.add_argument("--rate", default=None, help="with --launcher torchrun: every node's link rate (default 1gbit)")
    return p


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.replicas < 2:
        parser.error(f"argument --replicas: {a.replicas} must be >= 2 (one group is lost, another trains on)")
    if a.at_step < 1:
        parser.error(f"argument --at-step: {a.at_step} must be >= 1")
    if not a.stop_s > 0:
        parser.error(f"argument --stop-s: {a.stop_s} must be > 0 seconds")
    check_seeds_and_overrides(parser, a)
    owned = [o for o in a.overrides if o.split("=", 1)[0].lstrip("+~") in OWNED]
    if owned:
        parser.error(f"override(s) {owned}: the drill sets {', '.join(OWNED)} itself (--seeds, --replicas)")
    if a.launcher == "torchrun":
        a.rate = a.rate or "1gbit"
        live_drill_torchrun.check(parser, a)
    elif a.rate is not None:
        parser.error(f"argument --rate: {a.rate!r} applies to --launcher torchrun only (the local launcher runs on "
                     "loopback)")
    a.json = a.json or a.dir / "live_drill.json"
    return a


def _train_args(a: argparse.Namespace, seed: int, run_dir: Path) -> list[str]:
    # one torch thread per group unless an override says otherwise: R groups on one host, each a lone
    # process, would otherwise each take every core (pipesgd.train's default for a world of one)
    return [*WORKLOADS[a.workload], "dist.threads_per_worker=1", *a.overrides, f"seed={seed}",
            "trainer.log_every=1", f"hydra.run.dir={run_dir}"]


def _command(a: argparse.Namespace, seed: int, run_dir: Path) -> list[str]:
    """The local launcher's live job (``--launcher local``)."""
    return [sys.executable, "-m", "pipesgd.train", *_train_args(a, seed, run_dir), "trainer.mode=live",
            f"dist.nproc={a.replicas}", "dist.max_restarts=1"]


def _run(a: argparse.Namespace, seed: int, run_dir: Path, fault: str, watch=None) -> None:
    """The live job of ``seed`` into ``run_dir`` under ``--launcher``, ``PIPESGD_FAULT=fault``."""
    if a.launcher == "torchrun":
        log.info("$ PIPESGD_FAULT=%s (group %d) torchrun ... -m pipesgd.train %s (log %s.node*.log)", fault,
                 a.replicas - 1, recorded(_train_args(a, seed, run_dir)), run_dir)
        live_drill_torchrun.run_groups(_train_args(a, seed, run_dir), a.replicas, run_dir, a.rate, fault,
                                       a.timeout_s, watch)
        return
    cmd = _command(a, seed, run_dir)
    log.info("$ PIPESGD_FAULT=%s %s", fault, recorded(cmd))
    run_logged(cmd, run_dir.parent / f"{run_dir.name}.log", a.timeout_s, env={"PIPESGD_FAULT": fault}, watch=watch)


class _StopThenSignal:
    """``watch`` for :func:`run_logged`: wait for the faulted group's SIGSTOP (its fault line names
    its pid, and the kernel shows it stopped), ``stop_s`` seconds later send it ``sig``; the time
    that signal went is ``resumed_at``."""

    def __init__(self, train_log: Path, stop_s: float, sig: signal.Signals, deadline_s: float):
        self.log, self.stop_s, self.sig, self.deadline_s = Log(train_log), stop_s, sig, deadline_s
        self.pid: int | None = None
        self.resumed_at: float | None = None

    def __call__(self, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + self.deadline_s
        while self.pid is None or process_state(self.pid) != "T":
            if proc.poll() is not None:
                raise CellFailed(f"the live job exited with status {proc.returncode} before its group stopped")
            if time.monotonic() > deadline:
                raise CellFailed(f"no group stopped itself within {self.deadline_s:g} s ({self.log.path})")
            self.pid = next((int(m[2]) for line in self.log.poll() if (m := _FAULT.search(line))), None)
            time.sleep(0.05)
        time.sleep(self.stop_s)  # interrupted, run_logged stops the job's process group, this group with it
        self.resumed_at = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, self.sig)
        log.info("group's pid %d stopped for %.1f s, then %s", self.pid, self.stop_s, self.sig.name)


def _overrides_digest(a: argparse.Namespace) -> str:
    # the launcher and its link rate are part of the digest: a torchrun drill never reuses a local one's runs;
    # nor one from before its groups waited for each other at the start (live_drill_torchrun.group_command)
    parts = a.overrides if a.launcher == "local" else [*a.overrides, f"--launcher={a.launcher}", f"--rate={a.rate}",
                                                       "--start-barrier"]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def drill_dir(a: argparse.Namespace, seed: int) -> Path:
    """The faulted run's directory: named by the fault, the group count, the overrides' digest and
    the seed, so drills with other overrides (``trainer.live.timeout_s=2``) never share one."""
    stop = f"-{a.after_stop}" if a.fault == "stop" else ""
    return (a.dir / f"{a.workload}{_tag(a)}-{a.fault}{stop}-r{a.replicas}-{_overrides_digest(a)}-s{seed}").resolve()


def _tag(a: argparse.Namespace) -> str:
    return "" if a.launcher == "local" else f"-{a.launcher}"


def run_drill(a: argparse.Namespace, seed: int) -> tuple[Path, float | None]:
    """The faulted run of ``seed``, from scratch (a previous drill's directory of the same name is
    removed: resuming its checkpoints would not be the drill); returns its directory and when a
    stopped group was signalled."""
    run_dir = drill_dir(a, seed)
    if run_dir.exists():
        log.info("removing the previous drill's %s: a drill starts from scratch", run_dir)
        shutil.rmtree(run_dir)
    fault = f"{a.fault}:{a.replicas - 1}:{a.at_step}"
    watch = None
    if a.fault == "stop":
        sig = signal.SIGCONT if a.after_stop == "cont" else signal.SIGKILL
        watch = _StopThenSignal(replica_dir(run_dir, a.replicas - 1) / "train.log", a.stop_s, sig, a.timeout_s)
    _run(a, seed, run_dir, fault, watch)
    return run_dir, watch.resumed_at if watch is not None else None


def run_reference(a: argparse.Namespace, seed: int) -> Path:
    """The uninterrupted run of ``seed``, kept and reused by any drill of the same workload, group
    count and overrides (their digest is in the directory's name)."""
    run_dir = (a.dir / f"{a.workload}{_tag(a)}-reference-r{a.replicas}-{_overrides_digest(a)}-s{seed}").resolve()
    if not (run_dir / "summary.json").exists():
        _run(a, seed, run_dir, "")
    return run_dir


def _steps(lines: list[str]) -> list[tuple[float, int]]:
    return [(stamp(line), int(m[1])) for line in lines if (m := STEP.search(line))]


def _first_at_or_after(lines: list[str], t: float, what: str | re.Pattern) -> str | None:
    for line in lines:
        s = stamp(line)
        if s is not None and s >= t and (what.search(line) if isinstance(what, re.Pattern) else what in line):
            return line
    return None


def returning(lines: list[str], fault_at: float, resumed_at: float | None) -> dict:
    """The faulted group from its return: its (re)start, imports, setup (process group, data,
    model: until the mode's builder starts), heal and first step after it (``join_s``: the engine,
    torchft's Manager, the quorum and the state transfer). A group that was stopped and continued
    returns at ``resumed_at`` in the process it had."""
    starts = [(stamp(line), m) for line in lines if (m := STARTED.search(line)) and stamp(line) >= fault_at]
    if starts:  # the line is logged as the mode's builder starts: data and model are built by then
        built, m = starts[-1]
        started, imported, restart, pid = float(m[4]), float(m[5]), int(m[2]), int(m[3])
    else:  # the same process, continued
        built, started, imported, restart, pid = None, resumed_at, None, 0, None
    out = {"restart": restart, "pid": pid, "started_at": started, "imports_done_at": imported, "build_at": built,
           "import_s": imported - started if imported is not None else None,
           "setup_s": built - imported if built is not None else None}
    if started is None:
        return out
    healed = _first_at_or_after(lines, started, _HEALED)
    after = stamp(healed) if healed is not None else started
    first = next(((t, s) for t, s in _steps(lines) if t >= after), None)
    out |= {"healed": healed is not None, "healed_at": stamp(healed) if healed else None,
            "first_step": first[1] if first else None, "first_step_at": first[0] if first else None,
            "to_train_s": first[0] - started if first else None,
            "after_imports_s": first[0] - (imported if imported is not None else started) if first else None,
            "join_s": first[0] - (built if built is not None else started) if first else None}
    return out


def survivor(lines: list[str], fault_at: float, back_at: float) -> dict:
    """A survivor's longest gap between two steps from the fault until the returning group's first
    step (a donor's pause to hand its state included), and its median step before the fault."""
    steps = _steps(lines)
    before = [t1 - t0 for (t0, _), (t1, _) in zip(steps, steps[1:]) if t1 <= fault_at]
    during = [(t1 - t0, s1) for (t0, _), (t1, s1) in zip(steps, steps[1:]) if t1 > fault_at and t0 <= back_at]
    normal = statistics.median(before) if before else None
    gap, at = max(during) if during else (None, None)
    return {"normal_step_s": normal, "longest_gap_s": gap, "longest_gap_ends_at_step": at,
            "stall_s": gap - normal if gap is not None and normal is not None else None}


def updates_lost(survivors: dict[int, dict]) -> int:
    """The updates the survivors' common model lacks: the votes the survivors that never healed
    lost (a survivor that failed a vote its peers passed heals from them at the next quorum, and
    takes the update back with their state, so its own count overstates the loss); the most any
    survivor lost where every one of them healed."""
    kept = [s["live_skipped_commits"] for s in survivors.values() if s["live_healed"] == 0]
    return max(kept or [s["live_skipped_commits"] for s in survivors.values()])


def first_joint_step(logs: dict[int, list[str]], returning: int, since: float) -> dict | None:
    """The returning group's weights after its first update since it healed (after ``since``)
    against those of the peers that served it their state, after the same step's update (the
    engine logs both digests); None where it did not heal."""
    healer = [(int(m[2]), m[1]) for line in logs[returning]
              if (m := _DIGEST.search(line)) and m[3] == "healed" and stamp(line) >= since]
    if not healer:
        return None
    step, digest = healer[0]
    donors = {r: m[1] for r, lines in logs.items() if r != returning
              for line in lines if (m := _DIGEST.search(line)) and m[3] == "served" and int(m[2]) == step}
    return {"step": step, "healer": digest, "donors": donors,
            "identical": bool(donors) and all(d == digest for d in donors.values())}


def analyse(run_dir: Path, replicas: int, resumed_at: float | None) -> dict:
    """What the drill in ``run_dir`` cost (the fields are documented in docs/reliability.md)."""
    faulted = replicas - 1
    logs = {r: (replica_dir(run_dir, r) / "train.log").read_text(errors="replace").splitlines()
            for r in range(replicas)}
    summaries = {r: json.loads((replica_dir(run_dir, r) / "summary.json").read_text()) for r in range(replicas)}
    fault_line = next((line for line in logs[faulted] if _FAULT.search(line)), None)
    if fault_line is None:
        raise CellFailed(f"{run_dir}: group {faulted} logged no fault: did the run reach the fault's step?")
    m = _FAULT.search(fault_line)
    fault_at = stamp(fault_line)
    back = returning(logs[faulted], fault_at, resumed_at)
    back_at = back.get("first_step_at") or max(t for r in range(replicas) for t, _ in _steps(logs[r]))
    survivors = {r: survivor(logs[r], fault_at, back_at) for r in range(faulted)}
    stalls = [s["stall_s"] for s in survivors.values() if s["stall_s"] is not None]
    checksums = {r: s.get("param_checksum") for r, s in summaries.items()}
    return {
        "run_dir": str(run_dir), "fault": m[3], "faulted_group": faulted, "fault_step": int(m[4]),
        "fault_at": fault_at, "resumed_at": resumed_at,
        "updates_lost": updates_lost({r: summaries[r] for r in range(faulted)}),
        "survivors_stall_s": max(stalls) if stalls else None, "survivors": survivors, "returning": back,
        "skipped_commits": {r: s["live_skipped_commits"] for r, s in summaries.items()},
        "healed": {r: s["live_healed"] for r, s in summaries.items()},
        "first_joint_step": first_joint_step(logs, faulted, back.get("started_at") or fault_at),
        "param_checksums": checksums,
        "weights_agree": len(set(checksums.values())) == 1 and None not in checksums.values(),
        "test_accuracy": {r: s["test_accuracy"] for r, s in summaries.items()},
        "steps": {r: s["steps"] for r, s in summaries.items()},
    }


def result(a: argparse.Namespace, rows: list[dict]) -> dict:
    return {"workload": a.workload, "launcher": a.launcher, "rate": a.rate, "overrides": [*WORKLOADS[a.workload], *a.overrides], "replicas": a.replicas,
            "fault": a.fault, "at_step": a.at_step, "stop_s": a.stop_s if a.fault == "stop" else None,
            "after_stop": a.after_stop if a.fault == "stop" else None, "seeds": a.seeds,
            "runs": rows, "commit": git_commit(), "host": fingerprint(), "loadavg": list(os.getloadavg()),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def _yes(x: bool | None) -> str:
    return "–" if x is None else "yes" if x else "NO"


def table(res: dict) -> str:
    lines = ["| seed | fault | survivors' stall, s (longest gap − median step) | updates lost | "
             "returning group: imports + setup + join = to train, s | healed | same weights at the "
             "first joint step / at the end | "
             "accuracy, % (uninterrupted) |", "|---|---|---|---|---|---|---|---|"]
    for row in res["runs"]:
        d, back, joint = row["drill"], row["drill"]["returning"], row["drill"]["first_joint_step"]
        gaps = [s["longest_gap_s"] for s in d["survivors"].values() if s["longest_gap_s"] is not None]
        acc = 100 * d["test_accuracy"][0]
        ref = f" ({100 * row['reference_accuracy']:.2f})" if row.get("reference_accuracy") is not None else ""
        lines.append(f"| {row['seed']} | {d['fault']} at {d['fault_step']} of group {d['faulted_group']} | "
                     f"{_f(d['survivors_stall_s'])} ({_f(max(gaps) if gaps else None)}) | {d['updates_lost']} | "
                     f"{_f(back.get('import_s'))} + {_f(back.get('setup_s'))} + {_f(back.get('join_s'))} = "
                     f"{_f(back.get('to_train_s'))} | "
                     f"{'yes' if back.get('healed') else 'no'} | {_yes(joint['identical'] if joint else None)} / "
                     f"{_yes(d['weights_agree'])} | "
                     f"{acc:.2f}{ref} |")
    return "\n".join(lines)


def drill_seed(a: argparse.Namespace, seed: int) -> dict:
    """The faulted run of ``seed`` analysed, with the uninterrupted run's accuracy (``--reference``)."""
    run_dir, resumed_at = run_drill(a, seed)
    row = {"seed": seed, "drill": analyse(run_dir, a.replicas, resumed_at)}
    if a.reference:
        ref = json.loads((replica_dir(run_reference(a, seed), 0) / "summary.json").read_text())
        row["reference_accuracy"] = ref["test_accuracy"]
    return row


def main(argv: Sequence[str] | None = None) -> int:
    a = parse(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    rows, ok = [], True
    try:
        with stop_on_signals():  # SIGTERM stops the running job's process group, as Ctrl-C does
            for seed in a.seeds:
                try:
                    rows.append(drill_seed(a, seed))
                except CellFailed as e:
                    log.error("seed %d: %s", seed, e)
                    ok = False
    except Stopped as e:
        log.error("stopped by %s: %d seed(s) recorded", e.sig.name, len(rows))
        ok = False
    res = result(a, rows)
    save(a.json, res)
    print(table(res))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
