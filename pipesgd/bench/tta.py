"""``python -m pipesgd.bench.tta [options] [Hydra overrides for every run]``: the time-to-accuracy
study (docs/time-to-accuracy.md). Every phase is resumable: run it again and it continues.

Phases (``--phase``, default ``all`` = the four in order):

* ``curves``: one full-length run per (arm, seed) on loopback, ``<dir>/runs/<arm>-s<seed>``; an
  interrupted run resumes from its checkpoints, a finished one (summary.json) is skipped.
* ``timing``: per link, short runs of every arm interleaved, ``--repeats`` rounds, skipping the
  first ``--skip`` steps; appended to ``<dir>/timing.json`` after each run. Needs a quiet machine.
* ``validate``: the ``--validate-arms`` end to end on each link, ``<dir>/validate/<arm>-<link>``,
  each between ``--validate-bracket`` timing runs of its arm before and after. Needs a quiet machine.
* ``report``: compose accuracy-vs-step with seconds-per-step into ``--json`` (and ``--plot``).

Links other than ``loopback`` run under ``pipesgd.emulate`` (root). Exit status 1 if a run failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from pipesgd.checkpoint import CheckpointDir, CheckpointError
from pipesgd.emulate.netns import DEFAULT_MTU
from pipesgd.runinfo import git_commit, write_json_atomic

from . import tta_compose as compose
from . import tta_records as records
from .runner import CellFailed, CpuSampler, Stopped, cpu_split, recorded, run_logged, stop_on_signals

log = logging.getLogger("pipesgd.bench.tta")
ROOT = Path(__file__).resolve().parents[2]

RECIPE = "resnet_cifar_tta"
_K1 = ("trainer.width=1", "trainer.warmup_sync_steps=0", "trainer.staleness=none")
ARMS: dict[str, tuple[str, ...]] = {
    "ddp": ("trainer.mode=ddp", *_K1, "compressor=none"),
    "ddp-fp16": ("trainer.mode=ddp", *_K1, "compressor=fp16"),
    # torch's powerSGD_hook at rank 2, warm start and error feedback on, its default 1000 plain steps
    "ddp-powersgd": ("trainer.mode=ddp", *_K1, "compressor=powersgd", "compressor.rank=2"),
    "sync": ("trainer.mode=sync", *_K1, "compressor=none"),
    "pipe": ("trainer.mode=pipe", "trainer.width=2", "trainer.staleness=none", "compressor=none"),
    "pipe+lookahead": ("trainer.mode=pipe", "trainer.width=2", "trainer.staleness=lookahead", "compressor=none"),
    "pipe+lookahead-int8": ("trainer.mode=pipe", "trainer.width=2", "trainer.staleness=lookahead",
                            "compressor=int8"),
    "pipe+lookahead-fp16": ("trainer.mode=pipe", "trainer.width=2", "trainer.staleness=lookahead",
                            "compressor=fp16"),
    compose.COMPUTE_ARM: ("trainer.mode=local", *_K1, "compressor=none"),
}
"""Arm name (as in the bench grid) -> its overrides on the recipe. Spelled here only."""
TIMING_OVERRIDES = {"ddp-powersgd": ("compressor.ddp_start_iter=2",)}
"""What a timing run adds to an arm so that it times the arm's own step: torch's PowerSGD hook
compresses from its third step (not its 1001st); the composition charges the curve's plain steps
at the ``ddp`` arm's rate."""
TIMING_ONLY = (compose.COMPUTE_ARM,)
"""Arms that are timed but never trained to a curve: ``compute`` (every worker trains alone, no
communication) is the ceiling, the step time no scheme can beat on this machine."""
RECORDS = ROOT / "docs" / "tta-runs"
PHASES = ("curves", "timing", "validate", "report")


def _csv(value: str) -> list[str]:
    return [v for v in value.split(",") if v]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipesgd.bench.tta", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. data.root=PATH")
    p.add_argument("--phase", default="all", help=f"all or a comma-separated subset of {', '.join(PHASES)}")
    p.add_argument("--arms", default=",".join(a for a in ARMS if a not in TIMING_ONLY),
                   help=f"comma-separated, from {', '.join(ARMS)} (the timing phase adds {', '.join(TIMING_ONLY)})")
    p.add_argument("--records", type=Path, default=RECORDS,
                   help="one small JSON per finished curve and validation run, which the report reads "
                        f"(default {RECORDS.relative_to(ROOT)}: commit them)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds of the full-length runs (default 0)")
    p.add_argument("--links", default="100mbit,50mbit", help="comma-separated tc rates, or loopback")
    p.add_argument("--validate-arms", default="sync,pipe+lookahead", help="arms timed end to end per link")
    p.add_argument("--validate-steps", type=int, default=None,
                   help="stop each validation run after this many steps and compare at its last evaluation "
                        "(default: the whole recipe, compared at the target)")
    p.add_argument("--validate-bracket", type=int, default=1,
                   help="timing runs of the arm just before and just after each validation run, which the "
                        "report composes it against (default 1; 0: compose against --timing)")
    p.add_argument("--recipe", default=RECIPE, help=f"conf/experiment name (default {RECIPE})")
    p.add_argument("--dir", type=Path, default=ROOT / "outputs" / "tta", help="run dirs and timing.json")
    p.add_argument("--json", type=Path, default=ROOT / "docs" / "time-to-accuracy.json", help="the result")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "time-to-accuracy.png",
                   help="accuracy against wall-clock seconds on the first link ('' for none)")
    p.add_argument("--timing", type=Path, default=None,
                   help="the timing records the report composes (default <dir>/timing.json)")
    p.add_argument("--steps", type=int, default=40, help="timed steps per timing run (default 40)")
    p.add_argument("--skip", type=int, default=10, help="warm-up steps left out of the timing (default 10)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds per link (default 3)")
    p.add_argument("--workers", type=int, default=2, help="workers (= the recipe's dist.nproc; default 2)")
    p.add_argument("--timeout-s", type=float, default=86400.0, help="per run (default 1 day)")
    p.add_argument("--mtu", type=int, default=DEFAULT_MTU,
                   help=f"MTU of the emulated links (default {DEFAULT_MTU}; 1500: the earlier link)")
    return p


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    a = parser.parse_args(argv)
    a.phases = list(PHASES) if a.phase == "all" else _csv(a.phase)
    a.arms, a.links, a.validate_arms = _csv(a.arms), _csv(a.links), _csv(a.validate_arms)
    for name, values, allowed in (("--phase", a.phases, PHASES), ("--arms", a.arms, ARMS),
                                  ("--validate-arms", a.validate_arms, ARMS)):
        bad = [v for v in values if v not in allowed]
        if bad or not values and name != "--validate-arms":
            parser.error(f"argument {name}: {','.join(bad) or '(empty)'} is not one of {', '.join(allowed)}")
    try:
        a.seeds = [int(s) for s in _csv(a.seeds)]
    except ValueError:
        parser.error(f"argument --seeds: {a.seeds!r} is not a comma-separated list of integers")
    if not a.seeds or min(a.seeds) < 0:
        parser.error(f"argument --seeds: {a.seeds!r} must name at least one seed >= 0")
    if a.validate_steps is not None and a.validate_steps < 1:
        parser.error(f"argument --validate-steps: must be an integer >= 1, got {a.validate_steps}")
    if a.validate_bracket < 0:
        parser.error(f"argument --validate-bracket: must be an integer >= 0, got {a.validate_bracket}")
    for name, low in (("steps", 1), ("skip", 0), ("repeats", 1), ("workers", 1)):
        if getattr(a, name) < low:
            parser.error(f"argument --{name}: must be an integer >= {low}, got {getattr(a, name)}")
    if not a.links:
        parser.error("argument --links: name at least one link (a tc rate such as 100mbit, or loopback)")
    bad = [o for o in a.overrides if "=" not in o]
    if bad:
        parser.error(f"unexpected argument(s) {bad}: positional arguments are Hydra overrides key=value")
    if any(link != "loopback" for link in a.links) and set(a.phases) & {"timing", "validate"}:
        from pipesgd.emulate import EmulateUnavailable, preflight

        try:
            preflight()
        except EmulateUnavailable as e:
            parser.error(f"--links {','.join(a.links)} needs the emulated cluster: {e}")
    return a


# --- commands ------------------------------------------------------------------------------------


def train_command(a: argparse.Namespace, arm: str, link: str, run_dir: Path, extra: Sequence[str] = ()) -> list[str]:
    """``python -m pipesgd.train`` (under ``pipesgd.emulate`` on a shaped link) for one arm."""
    overrides = [f"+experiment={a.recipe}", *ARMS[arm], f"dist.nproc={a.workers}", *a.overrides, *extra,
                 f"hydra.run.dir={run_dir}"]  # the phase's own settings (extra) win over the user's
    if link == "loopback":
        return [sys.executable, "-m", "pipesgd.train", *overrides]
    return [sys.executable, "-m", "pipesgd.emulate", "--workers", str(a.workers), "--rate", link,
            "--timeout-s", str(int(a.timeout_s)), "--mtu", str(a.mtu), "--", *overrides]


def _run(cmd: list[str], log_path: Path, timeout_s: float, append: bool = False) -> bool:
    log.info("$ %s", recorded(cmd))
    try:
        run_logged(cmd, log_path, timeout_s, append=append)
        return True
    except CellFailed as e:
        log.error("%s", e)
        return False


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def segments_path(run_dir: Path) -> Path:
    """``<arm>-s<seed>.segments.json`` beside the run dir: one row per process that worked on the
    run (its commit, start, end and exit), so a curve resumed across commits says so."""
    return run_dir.parent / f"{run_dir.name}.segments.json"


def _segments(run_dir: Path) -> list[dict]:
    path = segments_path(run_dir)
    return json.loads(path.read_text()) if path.exists() else []


def _run_segment(cmd: list[str], run_dir: Path, timeout_s: float) -> bool:
    """One process of a curve: its row is written before it starts and completed when it returns,
    or when this driver is stopped (``ok: false`` and ``stopped``: the signal or exception; a row
    left at ``end: null`` means the driver itself was killed outright). The log is appended to,
    never overwritten."""
    rows = _segments(run_dir)
    rows.append({"commit": git_commit(), "start": _now(), "end": None, "ok": None, "command": recorded(cmd)})
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(segments_path(run_dir), rows)
    try:
        ok = _run(cmd, run_dir.parent / f"{run_dir.name}.log", timeout_s, append=True)
    except BaseException as e:  # Stopped, KeyboardInterrupt: the child has been stopped on the way
        rows[-1] |= {"end": _now(), "ok": False, "stopped": str(e) or type(e).__name__}
        write_json_atomic(segments_path(run_dir), rows)
        raise
    rows[-1] |= {"end": _now(), "ok": ok}
    write_json_atomic(segments_path(run_dir), rows)
    return ok


# --- phases --------------------------------------------------------------------------------------


def write_curve_record(a: argparse.Namespace, arm: str, seed: int, run_dir: Path) -> dict | None:
    """The run's record in ``--records`` from its summary.json and segments (None if it has no
    summary yet): what the report uses, small enough to commit when the run ends."""
    summary = run_dir / "summary.json"
    if not summary.exists():
        return None
    record = records.curve_record(arm, seed, ARMS[arm], a.recipe, json.loads(summary.read_text()),
                                  _segments(run_dir))
    a.records.mkdir(parents=True, exist_ok=True)
    write_json_atomic(records.record_path(a.records, arm, seed), record)
    return record


def run_curves(a: argparse.Namespace) -> bool:
    ok = True
    for seed in a.seeds:
        for arm in a.arms:
            if arm in TIMING_ONLY:
                continue
            run_dir = (a.dir / "runs" / f"{arm}-s{seed}").resolve()
            if (run_dir / "summary.json").exists():
                log.info("curve %s seed %d: done (%s)", arm, seed, run_dir)
                write_curve_record(a, arm, seed, run_dir)
                continue
            log.info("curve %s seed %d -> %s%s", arm, seed, run_dir,
                     " (resuming)" if (run_dir / "checkpoints").is_dir() else "")
            cmd = train_command(a, arm, "loopback", run_dir, [f"seed={seed}"])
            ok &= _run_segment(cmd, run_dir, a.timeout_s)
            record = write_curve_record(a, arm, seed, run_dir)
            if record is not None:
                log.info("curve %s seed %d: %s, final %.2f %%; record %s (commit it)", arm, seed,
                         "complete" if record["complete"] else f"NOT complete ({record['why_incomplete']})",
                         record["final_test_accuracy"], records.record_path(a.records, arm, seed))
    return ok


def timing_arms(a: argparse.Namespace) -> list[str]:
    """The timed arms: the requested ones and the ceiling (compute alone)."""
    return list(a.arms) + [arm for arm in TIMING_ONLY if arm not in a.arms]


WARMUP_TIMED = 20
"""Synchronous warm-up steps a pipe arm's timing run times (after ``--skip``), in its own process:
a compressed arm's warm-up already carries its compressor, so ``sync``'s rate would over-charge it."""


def timing_plan(a: argparse.Namespace, arm: str) -> dict:
    """A timing run's steps: ``--skip`` left out, then for a pipe arm :data:`WARMUP_TIMED` timed
    synchronous warm-up steps (``warmup`` = their [start, end) indices) and ``--skip`` more left out
    while the pipeline fills; then ``--steps`` timed steps of the arm itself from index ``first``."""
    if "trainer.mode=pipe" not in ARMS[arm]:
        return {"total": a.skip + a.steps, "warmup_sync_steps": 0, "warmup": None, "first": a.skip}
    sync_end = a.skip + WARMUP_TIMED
    return {"total": sync_end + a.skip + a.steps, "warmup_sync_steps": sync_end, "warmup": (a.skip, sync_end),
            "first": sync_end + a.skip}


def timing_row(a: argparse.Namespace, arm: str, link: str, run_dir: Path, rep: int) -> dict | None:
    """One short timing run of ``arm`` on ``link`` (see :func:`timing_plan`): its row, or None if
    the run failed."""
    plan = timing_plan(a, arm)
    extra = [f"trainer.max_steps={plan['total']}", f"trainer.warmup_sync_steps={plan['warmup_sync_steps']}",
             "trainer.eval_every_steps=null", f"trainer.log_every={plan['total']}",
             "trainer.checkpoint_every=null", "trainer.resume=never", *TIMING_OVERRIDES.get(arm, ())]
    cmd = train_command(a, arm, link, run_dir, extra)
    load = list(os.getloadavg())
    start = _now()
    with CpuSampler() as sampler:
        if not _run(cmd, run_dir.parent / f"{run_dir.name}.log", 3600.0):
            return None
    history = json.loads((run_dir / "history.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    first = plan["first"]
    steps = history["iter_ms"][first:]
    t0 = history["wall_time"][first - 1] if first else history["wall_time"][0]
    warm = history["iter_ms"][slice(*plan["warmup"])] if plan["warmup"] else []
    row = {"link": link, "arm": arm, "repeat": rep, "iter_ms": steps,
           "median_iter_ms": statistics.median(steps), "eval_s": summary["evals"][-1]["eval_s"],
           **({"warmup_iter_ms": warm, "median_warmup_ms": statistics.median(warm)} if warm else {}),
           "median_compute_ms": statistics.median(history["compute_ms"][first:]),
           "median_exposed_comm_ms": statistics.median(history["exposed_comm_ms"][first:]),
           "cpu": cpu_split([sampler.between(t0, history["wall_time"][-1])]),
           "loadavg_before": load, "command": recorded(cmd), "commit": git_commit(),
           "recipe": a.recipe, "start": start, "date": _now()}
    log.info("timing %s %s r%d: median %.1f ms/step, eval %.1f s", link, arm, rep, row["median_iter_ms"],
             row["eval_s"])
    return row


def run_timing(a: argparse.Namespace) -> bool:
    """Interleaved: round r runs every arm once on a link before round r+1, so a drift in the
    machine's speed spreads over all arms instead of biasing one."""
    path = a.dir / "timing.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    done = {(r["link"], r["arm"], r["repeat"]) for r in rows}
    ok = True
    for link in a.links:
        for rep in range(a.repeats):
            for arm in timing_arms(a):
                if (link, arm, rep) in done:
                    continue
                row = timing_row(a, arm, link, (a.dir / "timing" / link / f"{arm}-r{rep}").resolve(), rep)
                if row is None:
                    ok = False
                    continue
                rows.append(row)
                write_json_atomic(path, rows)
    return ok


def _validate_suffix(a: argparse.Namespace, link: str) -> str:
    return f"-{link}" + ("" if a.validate_steps is None else f"-{a.validate_steps}steps")


def _validate_dir(a: argparse.Namespace, arm: str, link: str) -> Path:
    return (a.dir / "validate" / f"{arm}{_validate_suffix(a, link)}").resolve()


def _bracket_path(a: argparse.Namespace, arm: str, link: str) -> Path:
    return a.dir / "validate" / f"{arm}{_validate_suffix(a, link)}.bracket.json"


def _time_bracket(a: argparse.Namespace, arm: str, link: str, side: str, bracket: dict) -> bool:
    """Fill ``bracket[side]`` up to ``--validate-bracket`` timing runs of the arm, saved after each."""
    ok = True
    for i in range(len(bracket[side]), a.validate_bracket):
        run_dir = (a.dir / "validate" / "bracket" / f"{arm}{_validate_suffix(a, link)}-{side}-r{i}").resolve()
        row = timing_row(a, arm, link, run_dir, i)
        if row is None:
            ok = False
            break
        bracket[side].append(row | {"side": side})
        _bracket_path(a, arm, link).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(_bracket_path(a, arm, link), bracket)
    return ok


def run_validation(a: argparse.Namespace) -> bool:
    """Each validation run between ``--validate-bracket`` timing runs of its arm just before and
    just after it, which the report composes it against: on a host whose speed drifts within the
    hour, timing taken beside the run is the only fair prediction of it."""
    ok = True
    for link in a.links:
        for arm in a.validate_arms:
            run_dir = _validate_dir(a, arm, link)
            bracket_path = _bracket_path(a, arm, link)
            done = (run_dir / "summary.json").exists()
            # a bracket belongs to one validation run: one that has to be run (again) is timed afresh
            bracket = json.loads(bracket_path.read_text()) if done and bracket_path.exists() else \
                {"before": [], "after": []}
            if not done:
                if not _time_bracket(a, arm, link, "before", bracket):
                    ok = False
                    continue
                # resume=never: a measured wall clock must come from one uninterrupted process
                extra = [f"seed={a.seeds[0]}", "trainer.resume=never"]
                if a.validate_steps is not None:  # a shorter schedule: compared at its last evaluation
                    extra += [f"trainer.max_steps={a.validate_steps}", "trainer.checkpoint_every=null"]
                cmd = train_command(a, arm, link, run_dir, extra)
                if not _run_segment(cmd, run_dir, a.timeout_s):
                    ok = False
                    continue
            if bracket["before"]:  # a run validated without a bracket is not given one after the fact
                ok &= _time_bracket(a, arm, link, "after", bracket)
            path = records.record_path(a.records, arm, a.seeds[0], "validate", _validate_suffix(a, link))
            record = records.curve_record(arm, a.seeds[0], ARMS[arm], a.recipe,
                                          json.loads((run_dir / "summary.json").read_text()), _segments(run_dir))
            a.records.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, record | {"kind": "validate", "link": link, "steps_limit": a.validate_steps,
                                              "bracket": bracket})
    return ok


# --- report --------------------------------------------------------------------------------------


def _checkpoint_curve(run_dir: Path) -> list[list[float]] | None:
    """The evaluations an unfinished run's newest checkpoint carries (None: no valid checkpoint)."""
    try:
        found = CheckpointDir(run_dir / "checkpoints").newest_valid() if run_dir.is_dir() else None
    except CheckpointError as e:
        log.warning("%s: %s", run_dir, e)
        return None
    return None if found is None else [[e["step"], 100 * e["test_accuracy"]] for e in found[1].get("evals", [])]


def load_runs(a: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """``(used, unfinished)`` for every requested (arm, seed): finished runs' records (refreshed
    from ``--dir``'s run dirs that have a summary), checked by :func:`records.usable_curves`;
    anything else (no record, an incomplete record, a run dir with checkpoints only) is listed as
    unfinished with the reason and its partial curve, never composed."""
    found: dict[tuple[str, int], dict] = {}
    missing = []
    for arm in a.arms:
        for seed in a.seeds:
            run_dir = a.dir / "runs" / f"{arm}-s{seed}"
            record = write_curve_record(a, arm, seed, run_dir)
            path = records.record_path(a.records, arm, seed)
            if record is None and path.exists():
                record = json.loads(path.read_text())
            if record is not None:
                found[(arm, seed)] = record
                continue
            curve = _checkpoint_curve(run_dir)
            missing.append({"arm": arm, "seed": seed, "complete": False, "curve": curve or [],
                            "why_incomplete": "running or stopped: checkpoints only" if curve is not None
                            else "no run"})
    used, unfinished = records.usable_curves(found)
    return used, unfinished + missing


def load_timing(a: argparse.Namespace) -> dict[str, dict]:
    path = a.timing if a.timing is not None else a.dir / "timing.json"
    if not path.exists():
        return {}
    return timing_by_link(records.check_timing(json.loads(path.read_text()), a.recipe, ARMS, a.overrides))


def timing_by_link(rows: list[dict]) -> dict[str, dict]:
    """Per link: each arm's median ms/step pooled over repeats (with the repeats' medians as the
    spread), the median evaluation time over every run on that link, and the runs' commits and dates."""
    out: dict[str, dict] = {}
    for r in rows:
        block = out.setdefault(r["link"], {"pooled": {}, "repeat_medians": {}, "eval_s": [], "cpu": {}, "runs": []})
        block["pooled"].setdefault(r["arm"], []).extend(r["iter_ms"])
        if r.get("warmup_iter_ms"):
            block.setdefault("warmup", {}).setdefault(r["arm"], []).extend(r["warmup_iter_ms"])
        block["repeat_medians"].setdefault(r["arm"], []).append(r["median_iter_ms"])
        block["eval_s"].append(r["eval_s"])
        block["cpu"].setdefault(r["arm"], r.get("cpu"))
        block["runs"].append(r.get("commit"))
        block.setdefault("mtu", set()).add(records.link_mtu(r["command"]))
        block.setdefault("dates", []).append(r.get("date"))
    return {link: {"step_ms": {arm: statistics.median(v) for arm, v in b["pooled"].items()},
                   "warmup_ms": {arm: statistics.median(v) for arm, v in b.get("warmup", {}).items()},
                   "repeat_median_ms": b["repeat_medians"], "eval_s": statistics.median(b["eval_s"]),
                   "cpu": b["cpu"], "commits": sorted({c for c in b["runs"] if c}), "mtu": _one_mtu(link, b["mtu"]),
                   "measured": [min(d for d in b["dates"] if d), max(d for d in b["dates"] if d)]}
            for link, b in out.items()}


def _one_mtu(link: str, mtus: set[int | None]) -> int | None:
    if len(mtus) > 1:
        raise records.Refused(f"timing records of link {link} ran on MTUs {sorted(mtus, key=str)}: one link, one MTU")
    return next(iter(mtus))


POWERSGD = "pipesgd.reduction.powersgd.PowerSGD"
TORCH_START_POWERSGD_ITER = 1000
"""torch's ``start_powerSGD_iter`` default: what a record from before ``compressor.ddp_start_iter`` ran."""


def _warmup(run: dict) -> tuple[int, str | None]:
    """(steps, arm whose step time they run at) before the arm's own step time applies: a pipe
    arm's synchronous warm-up (``sync``), or the plain allreduce steps torch's PowerSGD hook takes
    before it compresses (``ddp``)."""
    config = run.get("config") or {}
    trainer, compressor = config.get("trainer", {}), config.get("compressor", {})
    if trainer.get("mode") == "pipe":
        return int(trainer.get("warmup_sync_steps") or 0), "sync"
    if trainer.get("mode") == "ddp" and compressor.get("_target_") == POWERSGD:
        return int(compressor.get("ddp_start_iter", TORCH_START_POWERSGD_ITER)), "ddp"
    return 0, None


def _run_row(r: dict, targets: dict[str, float]) -> dict:
    row = {"name": r["arm"], "seed": r["seed"], "complete": r["complete"], "curve": r["curve"],
           "final_test_accuracy": r.get("final_test_accuracy") if r["complete"] else None}
    if r["complete"]:
        row |= {"steps_to_target": (compose.steps_to(r["curve"], targets["target"]) or (None,))[0],
                "crossings": compose.crossings(r["curve"], targets), "segments": r.get("segments", []),
                "git_commit_at_end": r.get("git_commit_at_end"), "config_digest": r.get("config_digest")}
        if r.get("provenance"):
            row["provenance"] = r["provenance"]
    else:
        row["why_incomplete"] = r.get("why_incomplete")
    return row


def _own_timing(a: argparse.Namespace, v: dict, rows: list[dict], warmup_at: dict[str, str]) -> dict | None:
    """Step, warm-up and evaluation time of a validation record's arm from bracket timing ``rows``
    (None if they cannot price it)."""
    block = timing_by_link(records.check_timing(rows, a.recipe, ARMS, a.overrides)).get(v["link"])
    if block is None or v["arm"] not in block["step_ms"]:
        return None
    warm = compose.warmup_rate(v["arm"], block["step_ms"], warmup_at, block["warmup_ms"])
    return {"step_ms": block["step_ms"][v["arm"]], "eval_s": block["eval_s"], "warmup_ms": warm}


def _validation(a: argparse.Namespace, links: dict, target: float, warmup: dict[str, int],
                used: list[dict], warmup_at: dict[str, str] | None = None) -> list[dict]:
    """Composed against measured, from the validation records of the arms and links timed. A record
    with a bracket (timing runs just before and after it) is composed against that bracket, with the
    before-only and after-only compositions beside it as the drift's range; one without, against
    the report's timing (``timing``: which)."""
    warmup_at = warmup_at or {}
    rows = []
    for path in sorted(a.records.glob("validate-*.json")) if a.records.is_dir() else []:
        v = json.loads(path.read_text())
        link, arm = v["link"], v["arm"]
        if v["recipe"] != a.recipe:
            continue
        limit = v.get("steps_limit")
        bracket = v.get("bracket") or {}
        sides = {side: bracket.get(side) or [] for side in ("before", "after")}
        if sides["before"] and sides["after"]:
            own = _own_timing(a, v, sides["before"] + sides["after"], warmup_at)
            ranges = [_own_timing(a, v, sides[side], warmup_at) for side in ("before", "after")]
            if any(t is None or warmup.get(arm, 0) and t["warmup_ms"] is None for t in (own, *ranges)):
                continue
            timing = "bracket"
        else:
            block = links.get(link)
            if block is None or arm not in block["step_ms"] or arm in block["unpriced"]:
                continue
            own = {"step_ms": block["step_ms"][arm], "eval_s": block["eval_s"],
                   "warmup_ms": block["warmup_ms"].get(arm)}
            ranges, timing = [], "report"

        def composed(t: dict) -> dict:
            return compose.validation_row(arm, link, v["curve"], v["eval_elapsed_s"], None if limit else target,
                                          t["step_ms"], t["eval_s"], warmup.get(arm, 0), t["warmup_ms"])
        row = composed(own) | {"timing": timing, "step_ms": own["step_ms"], "warmup_ms": own["warmup_ms"],
                               "eval_s": own["eval_s"]}
        if ranges:
            before, after = (composed(t)["composed_s"] for t in ranges)
            row |= {"composed_before_s": before, "composed_after_s": after,
                    "step_ms_before_after": [t["step_ms"] for t in ranges],
                    "bracket_dates": [sides["before"][0].get("start"), sides["after"][-1].get("date")]}
        loop = next((r for r in used if r["arm"] == arm and r["seed"] == v["seed"]), None)
        # a shortened run has its own (shorter) schedule, so its curve is not the loopback run's
        row["same_curve_as_loopback"] = None if loop is None or limit else loop["curve"] == v["curve"]
        row |= {"steps": limit, "seed": v["seed"], "segments": v.get("segments", []), "record": path.name}
        rows.append(row)
    return rows


def build_result(a: argparse.Namespace, used: list[dict], unfinished: list[dict], timing: dict[str, dict]) -> dict:
    finished = [{"name": r["arm"], "seed": r["seed"], "curve": r["curve"]} for r in used]
    targets = compose.targets_from([r["final_test_accuracy"] for r in used if r["arm"] == "sync"])
    warm = {r["arm"]: _warmup(r) for r in used}
    warmup = {arm: steps for arm, (steps, _) in warm.items()}
    warmup_at = {arm: at for arm, (_, at) in warm.items() if at}
    links = {}
    for link, t in timing.items():
        block = compose.compose_link(finished, t["step_ms"], t["eval_s"], warmup, targets, warmup_at,
                                     t.get("warmup_ms"))
        links[link] = block | {"repeat_median_ms": t["repeat_median_ms"], "cpu": t["cpu"],
                               "ceiling": compose.link_ceiling(block), "timing_commits": t["commits"],
                               "timing_measured": t["measured"], "link_mtu": t["mtu"]}
    reference = next((r for r in used if r["arm"] == "sync"), used[0] if used else None)
    result = {
        "recipe": {"experiment": a.recipe, "arms": {arm: list(ARMS[arm]) for arm in a.arms},
                   "overrides": list(a.overrides),
                   "config": None if reference is None else records.recipe_config(
                       reference["config"], {k for arm in a.arms for k in records.override_keys(ARMS[arm])},
                       reference.get("world_size"))},
        "target_accuracy": targets["target"], "same_accuracy_pp": compose.SAME_ACCURACY_PP,
        "targets": targets,
        "warmup": {arm: {"steps": n, "at": warmup_at.get(arm)} for arm, n in warmup.items()},
        "arms": [_run_row(r, targets) for r in used] + [_run_row(r, targets) for r in unfinished],
        "links": links, "validation": _validation(a, links, targets["target"], warmup, used, warmup_at),
        "timing_config": {"steps": a.steps, "skip": a.skip, "repeats": a.repeats, "workers": a.workers},
        "commit": git_commit(), "date": _now(),
    }
    return result | {"goals": compose.goals(result)}


def plot(result: dict, path: Path) -> None:
    """Test accuracy against wall-clock seconds on the first link, one curve per arm (its first seed)."""
    from pipesgd.report.errors import new_figure

    link = next(iter(result["links"]))
    block = result["links"][link]
    fig = new_figure(7.5, 4.5)
    ax = fig.add_subplot()
    seen = set()
    for run in result["arms"]:
        arm = run["name"]
        if arm in seen or not run["complete"] or arm not in block["step_ms"] or arm in block["unpriced"]:
            continue
        seen.add(arm)
        pts = compose.wall_curve(run["curve"], block["step_ms"][arm], block["eval_s"],
                                 result["warmup"].get(arm, {"steps": 0})["steps"], block["warmup_ms"].get(arm))
        ax.plot([p[0] / 60 for p in pts], [p[1] for p in pts], label=f"{arm} ({block['step_ms'][arm]:.0f} ms/step)",
                lw=1.6 if arm.startswith("pipe") else 1.1)
    ax.axhline(result["target_accuracy"], color="0.4", ls="--", lw=0.8)
    ax.text(0.01, result["target_accuracy"], f"target {result['target_accuracy']:.2f} %", va="bottom", fontsize=8,
            transform=ax.get_yaxis_transform())
    top = max((p[1] for r in result["arms"] for p in r["curve"]), default=100)
    ax.set_ylim(max(0, top - 25), min(100, top + 2))
    ax.set_xlabel(f"wall-clock minutes at {link} (composed: steps × measured ms/step + evaluations)")
    ax.set_ylabel("test accuracy %")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def report(a: argparse.Namespace) -> dict:
    used, unfinished = load_runs(a)
    for r in unfinished:
        log.warning("not used: %s seed %d (%s)", r["arm"], r["seed"], r.get("why_incomplete"))
    result = build_result(a, used, unfinished, load_timing(a))
    a.json.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(a.json, result)
    if str(a.plot) not in ("", ".") and result["links"]:
        plot(result, a.plot)
    print(compose.table(result))
    print(compose.goals_table(result["goals"]))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    a = parse(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    a.dir.mkdir(parents=True, exist_ok=True)
    ok = True
    started = time.perf_counter()
    try:
        with stop_on_signals():
            for phase, run in (("curves", run_curves), ("timing", run_timing), ("validate", run_validation)):
                if phase in a.phases:
                    ok &= run(a)
    except Stopped as e:
        log.error("stopped by %s after %.0f s; run the same command again to resume", e.sig.name,
                  time.perf_counter() - started)
        return 128 + e.sig
    if "report" in a.phases:
        try:
            report(a)
        except ValueError as e:
            log.error("report: %s", e)
            return 1
    log.info("done in %.0f s", time.perf_counter() - started)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
