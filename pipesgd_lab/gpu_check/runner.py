"""The whole GPU check in one command (``make gpu-check``; docs/gpu.md, "The GPU check").

Runs each check of :mod:`pipesgd_lab.gpu_check.checks` in a subprocess of its own with its own time
budget, the most decisive first, and writes one results folder::

    <out>/results.json    every check: status, seconds, budget, its one-line summary, details
    <out>/gpu-check.log   everything the checks printed, check by check
    <out>/trace.json      the torch.profiler trace of three overlapped steps (the overlap check)
    <out>/step_times.json the measured compute preset the scale map reads (the step-times check)

and prints one summary line per check. A check that overruns its budget is killed (its whole
process group) and recorded as ``timeout``; one that crashes is ``error`` with its last line.
``--dry-run`` lists the checks and their budgets and touches no GPU (CI runs it on the CPU).

    python -m pipesgd_lab.gpu_check [--out DIR] [--only NAME ...] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .checks import CHECKS, Check
from .environment import ROOT, environment

TOTAL_BUDGET_S = 8 * 60
STATUSES = ("pass", "fail", "skip", "timeout", "error")


@dataclass
class Outcome:
    """One check's result as results.json records it."""

    name: str
    status: str
    seconds: float
    budget_s: float
    summary: str
    details: dict = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.status.upper():7s} {self.name:14s} {self.seconds:6.1f}/{self.budget_s:.0f} s  {self.summary}"


def parse_result(name: str, budget_s: float, seconds: float, returncode: int | None, result_file: Path,
                 output_tail: str) -> Outcome:
    """What a check's subprocess left behind, as an :class:`Outcome`: its result file if it wrote a
    valid one; ``timeout`` if it was killed at its budget; ``error`` (with the last line it printed)
    for a crash, a missing or malformed result, or a status not in :data:`STATUSES`."""
    if returncode is None:
        return Outcome(name, "timeout", seconds, budget_s, f"killed after its budget of {budget_s:.0f} s")
    last = next((ln for ln in reversed(output_tail.strip().splitlines()) if ln.strip()), "")
    try:
        data = json.loads(result_file.read_text())
    except FileNotFoundError:
        return Outcome(name, "error", seconds, budget_s, f"exit code {returncode}, no result: {last}")
    except json.JSONDecodeError as e:
        return Outcome(name, "error", seconds, budget_s, f"malformed result file ({e})")
    status = data.get("status") if isinstance(data, dict) else None
    if status not in STATUSES:
        return Outcome(name, "error", seconds, budget_s, f"result has status {status!r}, not one of {STATUSES}")
    if returncode != 0 and status == "pass":
        return Outcome(name, "error", seconds, budget_s, f"exit code {returncode} after reporting pass: {last}")
    return Outcome(name, status, seconds, budget_s, str(data.get("summary", "")).splitlines()[0] if data.get(
        "summary") else "", data.get("details", {}))


def run_check(check: Check, out: Path, log, argv: list[str] | None = None) -> Outcome:
    """``check`` in a subprocess (its own process group, so a timeout kills its workers too);
    ``argv``: another command in its place (the tests' hanging and crashing stand-ins)."""
    result_file = out / "checks" / f"{check.name}.json"
    result_file.parent.mkdir(parents=True, exist_ok=True)
    result_file.unlink(missing_ok=True)
    log.write(f"\n===== {check.name} (budget {check.budget_s:.0f} s) =====\n")
    log.flush()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    argv = argv or [sys.executable, "-m", "pipesgd_lab.gpu_check.checks", check.name, str(result_file), str(out)]
    proc = subprocess.Popen(argv,
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=check.budget_s)
        returncode: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        returncode = None
    seconds = time.monotonic() - start
    log.write(output or "")
    log.flush()
    return parse_result(check.name, check.budget_s, seconds, returncode, result_file, output or "")


def selected(only: list[str] | None) -> list[Check]:
    if not only:
        return list(CHECKS)
    known = {c.name for c in CHECKS}
    bad = [n for n in only if n not in known]
    if bad:
        raise SystemExit(f"--only {' '.join(bad)}: no such check; the checks are {', '.join(sorted(known))}")
    return [c for c in CHECKS if c.name in only]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default: results/gpu/<date>-<gpu>/, where a run is committed)")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these checks")
    p.add_argument("--dry-run", action="store_true", help="list the checks and their budgets; run nothing")
    args = p.parse_args(argv)
    checks = selected(args.only)
    if args.dry_run:
        for c in checks:
            print(f"{c.name:14s} {c.budget_s:5.0f} s  {c.what}")
        one = sum(c.budget_s for c in checks if c.gpus == 1)
        print(f"{'total':14s} {one:5.0f} s  on one GPU (at most {TOTAL_BUDGET_S} s); "
              f"{sum(c.budget_s for c in checks):.0f} s with two or more")
        return 0
    env = environment()
    if not env.get("gpus"):
        print(f"no CUDA GPU visible to this Python (torch {env.get('torch')}); the GPU check needs one: "
              "see docs/gpu.md, 'The GPU check'", file=sys.stderr)
        return 2
    gpu = "".join(ch if ch.isalnum() else "-" for ch in env["gpu"].lower()).strip("-")
    out = args.out or ROOT / "results" / "gpu" / f"{env['date'][:10]}-{gpu}"
    out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    with open(out / "gpu-check.log", "w") as log:
        log.write(json.dumps(env, indent=1) + "\n")
        for check in checks:
            if env["gpus"] < check.gpus:  # no subprocess, no CUDA start-up: nothing of the 8 minutes
                outcome = Outcome(check.name, "skip", 0.0, check.budget_s,
                                  f"needs {check.gpus} GPUs, {env['gpus']} visible")
            else:
                outcome = run_check(check, out, log)
            outcomes.append(outcome)
            print(outcome.line(), flush=True)
    (out / "results.json").write_text(json.dumps(
        {"environment": env, "checks": [asdict(o) for o in outcomes]}, indent=1) + "\n")
    print(f"results in {out}")
    return 0 if all(o.status in ("pass", "skip") for o in outcomes) else 1
