"""``python -m pipesgd_lab.bench.tta [options] [Hydra overrides for every run]``: the time-to-accuracy
study (docs/time-to-accuracy.md). Every phase is resumable: run it again and it continues.

Phases (``--phase``, default ``all`` = the four in order):

* ``curves``: one full-length run per (arm, seed) on loopback, ``<dir>/runs/<arm>-s<seed>``; an
  interrupted run resumes from its checkpoints, a finished one (summary.json) is skipped.
* ``timing``: per link, short runs of every arm interleaved, ``--repeats`` rounds, skipping the
  first ``--skip`` steps; appended to ``<dir>/timing.json`` (``timing-<M>x<k>.json`` for several ranks per
  replica) after each run. Needs a quiet machine.
* ``validate``: the ``--validate-arms`` end to end on each link, ``<dir>/validate/<arm>-<link>``,
  each between ``--validate-bracket`` timing runs of its arm before and after, which time
  ``--bracket-steps`` steps after ``--bracket-skip``. Needs a quiet machine.
* ``report``: compose accuracy-vs-step with seconds-per-step into ``--json`` (and ``--plot``).

Links other than ``loopback`` run under ``pipesgd_lab.emulate`` (root). ``--ranks-per-replica k`` runs
every arm as ``--workers`` replicas of k ranks each, at the same global batch (tta_shape.py), a
replica per emulated host. Exit status 1 if a run failed.
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
from pathlib import Path

from pipesgd.live.launch import replica_dir
from pipesgd.modes import get_mode
from pipesgd.observability.hostinfo import fingerprint
from pipesgd.observability.runinfo import git_commit, write_json_atomic
from pipesgd_lab.emulate.netns import DEFAULT_MTU

from . import probe
from . import tta_records as records
from . import tta_shape
from .tta_compose import COMPUTE_ARM

from .tta_arms import ARMS, DEFAULT_ARMS, RECIPE, TIMING_ONLY, WARMUP_KEYS, arm_mode, metric_for, sync_every
from .tta_report import report, timing_path, write_curve_record
from .runner import CellFailed, CpuSampler, Stopped, cpu_split, recorded, run_logged, stop_on_signals

log = logging.getLogger("pipesgd_lab.bench.tta")
ROOT = Path()  # paths below are the current directory's (a clone's root keeps its records in place)

RECORDS = ROOT / "results" / "time-to-accuracy" / "runs"
PHASES = ("curves", "timing", "validate", "report")


def _csv(value: str) -> list[str]:
    return [v for v in value.split(",") if v]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipesgd_lab.bench.tta", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. data.root=PATH")
    p.add_argument("--phase", default="all", help=f"all or a comma-separated subset of {', '.join(PHASES)}")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                   help=f"comma-separated (default {', '.join(DEFAULT_ARMS)}), from those and the period-H study's "
                        "DiLoCo arms, <family>-h<H> (diloco-eager-int8, diloco-none-int8, diloco-blocking, "
                        "diloco-blocking-int8, torchft-diloco, torchft-streaming; H in 2, 4, 5, 8, 10, 20, 25, 50, "
                        f"100); the timing phase adds {', '.join(TIMING_ONLY)}")
    p.add_argument("--records", type=Path, default=RECORDS,
                   help="one small JSON per finished curve and validation run, which the report reads "
                        f"(default {RECORDS}: commit them)")
    p.add_argument("--validations", type=Path, default=None,
                   help="the folder whose validate-*.json records the report judges (default: --records); "
                        "a dated folder, e.g. results/time-to-accuracy/runs/validation-2026-11-29, keeps a timing file's own "
                        "validations beside it")
    p.add_argument("--seeds", default="0", help="comma-separated seeds of the full-length runs (default 0)")
    p.add_argument("--links", default="100mbit,50mbit", help="comma-separated tc rates, or loopback")
    p.add_argument("--validate-arms", default="sync,pipe+lookahead", help="arms timed end to end per link")
    p.add_argument("--validate-steps", type=int, default=None,
                   help="stop each validation run after this many steps and compare at its last evaluation "
                        "(default: the whole recipe, compared at the target)")
    p.add_argument("--validate-bracket", type=int, default=1,
                   help="timing runs of the arm just before and just after each validation run, which the "
                        "report composes it against (default 1; 0: compose against --timing)")
    p.add_argument("--bracket-skip", type=int, default=100,
                   help="steps a bracket's timing run leaves out before its window (default 100: past start-up, "
                        "where a long run spends its steps)")
    p.add_argument("--bracket-steps", type=int, default=100, help="timed steps per bracket run (default 100)")
    p.add_argument("--recipe", default=RECIPE, help=f"conf/experiment name (default {RECIPE})")
    p.add_argument("--dir", type=Path, default=ROOT / "outputs" / "tta", help="run dirs and timing.json")
    p.add_argument("--json", type=Path, default=None,
                   help="the result (default results/time-to-accuracy/time-to-accuracy.json; another --recipe: "
                        "results/<recipe>/time-to-target-<recipe>.json, '_' read '-' in the folder, "
                        "so a study never overwrites another's)")
    p.add_argument("--plot", type=Path, default=None,
                   help="the metric against wall-clock seconds on the first link, or against the step where "
                        "no timing exists ('' for none; default docs/img/time-to-accuracy.png, another --recipe: "
                        "docs/img/time-to-target-<recipe>.png)")
    p.add_argument("--timing", type=Path, default=None,
                   help="the timing records the report composes (default <dir>/timing.json)")
    p.add_argument("--steps", type=int, default=40, help="timed steps per timing run (default 40)")
    p.add_argument("--skip", type=int, default=10, help="warm-up steps left out of the timing (default 10)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds per link (default 3)")
    p.add_argument("--workers", type=int, default=2,
                   help="replicas (= the recipe's dist.nproc at --ranks-per-replica 1; default 2)")
    p.add_argument("--ranks-per-replica", type=int, default=1, metavar="K",
                   help="ranks in each replica (default 1): every arm runs as --workers replicas of K ranks "
                        "(dist.ranks_per_replica=K; on a shaped link, one emulated host per replica), each rank at "
                        "1/K of the recipe's per-rank batch, so the global batch stays the recipe's; records, run "
                        "directories and the result are named -<workers>x<K>")
    p.add_argument("--timeout-s", type=float, default=86400.0, help="per run (default 1 day)")
    p.add_argument("--probe-s", type=float, default=1.0,
                   help="seconds of the host-speed probe (fixed matrix products on every core) just before and "
                        "just after each timing run: whether the host held still while it ran "
                        "(default 1; 0: no probe)")
    p.add_argument("--stamp-host", default="", metavar="RUNS",
                   help="comma-separated runs, e.g. ddp-powersgd-s1,ddp-powersgd-s2, whose records, built from run "
                        "dirs whose summary.json has no host fingerprint (code from before it), get this host's, "
                        "marked as stamped: name only runs that ran wholly on this host (default: none; such a "
                        "record says its host is unknown)")
    p.add_argument("--mixed-hosts", action="store_true",
                   help="compose an arm whose seeds ran on different kinds of host (default: refused); the "
                        "JSON says which arms were")
    p.add_argument("--mtu", type=int, default=DEFAULT_MTU,
                   help=f"MTU of the emulated links (default {DEFAULT_MTU}; 1500: the earlier link)")
    return p


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    a = parser.parse_args(argv)
    a.phases = list(PHASES) if a.phase == "all" else _csv(a.phase)
    a.arms, a.links, a.validate_arms = _csv(a.arms), _csv(a.links), _csv(a.validate_arms)
    a.shape = _shape(parser, a)
    stem = ("time-to-accuracy" if a.recipe == RECIPE else f"time-to-target-{a.recipe}") + a.shape.label
    folder = "time-to-accuracy" if a.recipe == RECIPE else a.recipe.replace("_", "-")  # results/gpt-shakespeare
    a.json = ROOT / "results" / folder / f"{stem}.json" if a.json is None else a.json
    a.plot = ROOT / "docs" / "img" / f"{stem}.png" if a.plot is None else a.plot
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
    a.stamp_host = set(_csv(a.stamp_host))
    known = {f"{arm}-s{seed}" for arm in a.arms for seed in a.seeds}
    if a.stamp_host - known:
        parser.error(f"argument --stamp-host: {','.join(sorted(a.stamp_host - known))} is not a run of --arms and "
                     f"--seeds (<arm>-s<seed>, e.g. {next(iter(sorted(known)))})")
    if a.validations is not None and not a.validations.is_dir():
        parser.error(f"argument --validations: {a.validations} is not a folder (one that holds validate-*.json records)")
    if a.validate_steps is not None and a.validate_steps < 1:
        parser.error(f"argument --validate-steps: must be an integer >= 1, got {a.validate_steps}")
    if a.validate_bracket < 0:
        parser.error(f"argument --validate-bracket: must be an integer >= 0, got {a.validate_bracket}")
    for name, low in (("steps", 1), ("skip", 0), ("repeats", 1), ("bracket_steps", 1), ("bracket_skip", 0)):
        if getattr(a, name) < low:
            parser.error(f"argument --{name.replace('_', '-')}: must be an integer >= {low}, got {getattr(a, name)}")
    if a.probe_s < 0:
        parser.error(f"argument --probe-s: must be >= 0 seconds (0: no probe), got {a.probe_s}")
    if not a.links:
        parser.error("argument --links: name at least one link (a tc rate such as 100mbit, or loopback)")
    bad = [o for o in a.overrides if "=" not in o]
    if bad:
        parser.error(f"unexpected argument(s) {bad}: positional arguments are Hydra overrides key=value")
    if any(link != "loopback" for link in a.links) and set(a.phases) & {"timing", "validate"}:
        from pipesgd_lab.emulate import EmulateUnavailable, preflight

        try:
            preflight()
        except EmulateUnavailable as e:
            parser.error(f"--links {','.join(a.links)} needs the emulated cluster: {e}")
    return a


def _shape(parser: argparse.ArgumentParser, a: argparse.Namespace) -> tta_shape.Shape:
    """The study's :class:`~.tta_shape.Shape` from ``--workers`` and ``--ranks-per-replica``
    (``parser.error`` naming the option where it cannot hold), before anything runs."""
    for option, value in (("--workers", a.workers), ("--ranks-per-replica", a.ranks_per_replica)):
        if value < 1:
            parser.error(f"argument {option}: must be an integer >= 1, got {value}")
    given = [o for o in a.overrides if o.lstrip("+").startswith(f"{tta_shape.REPLICA_KEY}=")]
    if given:
        parser.error(f"override {given[0]}: the study's shape is --ranks-per-replica (which sets it for every arm)")
    k = a.ranks_per_replica
    if k == 1:
        return tta_shape.Shape(a.workers)
    try:
        return tta_shape.shape_for(a.workers, k, tta_shape.compose_recipe(a.recipe, a.overrides))
    except ValueError as e:
        parser.error(f"argument --ranks-per-replica: {e}")


# --- commands ------------------------------------------------------------------------------------


def train_command(a: argparse.Namespace, arm: str, link: str, run_dir: Path, extra: Sequence[str] = ()) -> list[str]:
    """``python -m pipesgd.train`` (under ``pipesgd_lab.emulate`` on a shaped link) for one arm; torchft's
    arms on a shaped link, or in groups of several ranks, as torchrun jobs behind a lighthouse (live_groups)."""
    groups = get_mode(arm_mode(arm)).launcher is not None  # torchft_diloco: replica groups behind a lighthouse
    # the compute-alone arm exchanges nothing, so it has no replicas to form: its ranks run at the
    # shape's per-rank batch, one per emulated host (no link carries anything either way)
    alone = arm == COMPUTE_ARM
    k = 1 if alone else a.shape.ranks_per_replica
    # the shape's per-rank settings win over the user's (computed from them), the phase's own (extra) over both;
    # a torchft group's ranks are its torchrun job's (live_groups --ranks-per-replica), not dist.ranks_per_replica
    overrides = [f"+experiment={a.recipe}", *ARMS[arm], f"dist.nproc={a.shape.world}", *a.overrides,
                 *a.shape.overrides(replica_key=not (groups or alone)), *extra, f"hydra.run.dir={run_dir}"]
    if link == "loopback" and not (groups and k > 1):  # the live launcher starts lone processes only
        return [sys.executable, "-m", "pipesgd.train", *overrides]
    # a replica per emulated host (or per torchrun job on loopback)
    shape = ["--workers", str(a.shape.world if alone else a.shape.replicas)] + (
        ["--ranks-per-replica", str(k)] if k > 1 else [])
    link_args = ["--rate", link, "--timeout-s", str(int(a.timeout_s))] + ([] if link == "loopback" else
                                                                          ["--mtu", str(a.mtu)])
    module = "pipesgd_lab.bench.live_groups" if groups else "pipesgd_lab.emulate"
    return [sys.executable, "-m", module, *shape, *link_args, "--", *overrides]


def _run(cmd: list[str], log_path: Path, timeout_s: float, append: bool = False) -> bool:
    log.info("$ %s", recorded(cmd))
    try:
        run_logged(cmd, log_path, timeout_s, append=append)
        return True
    except CellFailed as e:
        log.error("%s", e)
        return False


def _run_segment(cmd: list[str], run_dir: Path, timeout_s: float) -> bool:
    """One process of a curve: its row is written before it starts and completed when it returns,
    or when this driver is stopped (``ok: false`` and ``stopped``: the signal or exception; a row
    left at ``end: null`` means the driver itself was killed outright). The log is appended to,
    never overwritten."""
    rows = records.read_segments(run_dir)
    rows.append({"commit": git_commit(), "start": records.now(), "end": None, "ok": None, "command": recorded(cmd)})
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(records.segments_path(run_dir), rows)
    try:
        ok = _run(cmd, run_dir.parent / f"{run_dir.name}.log", timeout_s, append=True)
    except BaseException as e:  # Stopped, KeyboardInterrupt: the child has been stopped on the way
        rows[-1] |= {"end": records.now(), "ok": False, "stopped": str(e) or type(e).__name__}
        write_json_atomic(records.segments_path(run_dir), rows)
        raise
    rows[-1] |= {"end": records.now(), "ok": ok}
    write_json_atomic(records.segments_path(run_dir), rows)
    return ok


# --- phases --------------------------------------------------------------------------------------


def run_curves(a: argparse.Namespace) -> bool:
    ok = True
    for seed in a.seeds:
        for arm in a.arms:
            if arm in TIMING_ONLY:
                continue
            run_dir = (a.dir / "runs" / f"{arm}{a.shape.label}-s{seed}").resolve()
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
                log.info("curve %s seed %d: %s, final %s %.4g; record %s (commit it)", arm, seed,
                         "complete" if record["complete"] else f"NOT complete ({record['why_incomplete']})",
                         record["metric"], record[f"final_{record['metric']}"],
                         records.record_path(a.records, arm, seed, shape=a.shape.label))
    return ok


def timing_arms(a: argparse.Namespace) -> list[str]:
    """The timed arms: the requested ones and the ceiling (compute alone)."""
    return list(a.arms) + [arm for arm in TIMING_ONLY if arm not in a.arms]


WARMUP_TIMED = 20
"""Warm-up steps an arm's timing run times as they run (after ``--skip``), in its own process: a
pipe arm's synchronous steps (with a compressor they already carry it, so ``sync``'s rate would
over-charge them), ``ddp-powersgd``'s plain allreduce steps through torch's hook."""


def _whole_rounds(steps: int, h: int, least: int) -> int:
    """``steps``, at least ``least``, rounded up to whole rounds of ``h`` steps."""
    return -(-max(steps, least) // h) * h


def timing_plan(a: argparse.Namespace, arm: str) -> dict:
    """A timing run's steps: ``--skip`` left out, then for an arm with a warm-up (:data:`WARMUP_KEYS`)
    :data:`WARMUP_TIMED` timed warm-up steps (``warmup`` = their [start, end) indices) and ``--skip``
    more left out while the arm's own scheme starts (the pipeline fills, PowerSGD's first factors);
    then ``--steps`` timed steps of the arm itself from index ``first``. ``overrides``: the settings
    that make the run do so."""
    key = WARMUP_KEYS.get(arm)
    h = sync_every(arm)
    if h > 1:  # whole rounds, each timed with its exchange: at least one left out and one timed
        skip, steps = _whole_rounds(a.skip, h, h), _whole_rounds(a.steps, h, h)
        return {"total": skip + steps, "overrides": [], "warmup": None, "first": skip}
    if key is None:
        return {"total": a.skip + a.steps, "overrides": ["trainer.warmup_sync_steps=0"], "warmup": None,
                "first": a.skip}
    sync_end = a.skip + WARMUP_TIMED
    overrides = [] if key == "trainer.warmup_sync_steps" else ["trainer.warmup_sync_steps=0"]
    return {"total": sync_end + a.skip + a.steps, "overrides": [*overrides, f"{key}={sync_end}"],
            "warmup": (a.skip, sync_end), "first": sync_end + a.skip}


def timing_row(a: argparse.Namespace, arm: str, link: str, run_dir: Path, rep: int) -> dict | None:
    """One short timing run of ``arm`` on ``link`` (see :func:`timing_plan`): its row, or None if
    the run failed."""
    plan = timing_plan(a, arm)
    extra = [f"trainer.max_steps={plan['total']}", *plan["overrides"],
             "trainer.eval_every_steps=null", f"trainer.log_every={plan['total']}",
             "trainer.checkpoint_every=null", "trainer.resume=never"]
    cmd = train_command(a, arm, link, run_dir, extra)
    load = list(os.getloadavg())
    start = records.now()
    with probe.around(a.probe_s) as host_speed, CpuSampler() as sampler:
        if not _run(cmd, run_dir.parent / f"{run_dir.name}.log", 3600.0):
            return None
    files = run_dir if (run_dir / "history.json").exists() else replica_dir(run_dir, 0)  # a live launcher's run
    history = json.loads((files / "history.json").read_text())
    summary = json.loads((files / "summary.json").read_text())
    first = plan["first"]
    steps = history["iter_ms"][first:]
    t0 = history["wall_time"][first - 1] if first else history["wall_time"][0]
    warm = history["iter_ms"][slice(*plan["warmup"])] if plan["warmup"] else []
    window = {"first": first, "steps": len(steps), "warmup": list(plan["warmup"]) if plan["warmup"] else None}
    row = {"link": link, "arm": arm, "repeat": rep, **tta_shape.run_shape(summary), "iter_ms": steps, "window": window,
           "median_iter_ms": statistics.median(steps), "eval_s": summary["evals"][-1]["eval_s"],
           **({"warmup_iter_ms": warm, "median_warmup_ms": statistics.median(warm)} if warm else {}),
           "median_compute_ms": statistics.median(history["compute_ms"][first:]),
           "median_exposed_comm_ms": statistics.median(history["exposed_comm_ms"][first:]),
           # one worker's bytes in a step that sent (its summary's median): the record keeps it, the
           # run directory need not outlive the machine
           "sent_bytes": summary.get("bytes_per_step"),
           "cpu": cpu_split([sampler.between(t0, history["wall_time"][-1])]),
           "loadavg_before": load, "host_speed": host_speed or None,
           "command": recorded(cmd), "commit": git_commit(),
           "host": summary.get("host") or fingerprint(), "placement": summary.get("placement"),
           "recipe": a.recipe, "start": start, "date": records.now()}
    probed = f"; host {host_speed['before']['gflops']:.1f} -> {host_speed['after']['gflops']:.1f} GFLOP/s" \
        if host_speed else ""
    log.info("timing %s %s r%d: median %.1f ms/step, eval %.1f s%s", link, arm, rep, row["median_iter_ms"],
             row["eval_s"], probed)
    return row


def run_timing(a: argparse.Namespace) -> bool:
    """Interleaved: round r runs every arm once on a link before round r+1, so a drift in the
    machine's speed spreads over all arms instead of biasing one."""
    path = timing_path(a)
    rows = json.loads(path.read_text()) if path.exists() else []
    done = {(r["link"], r["arm"], r["repeat"]) for r in rows}
    ok = True
    for link in a.links:
        for rep in range(a.repeats):
            for arm in timing_arms(a):
                if (link, arm, rep) in done:
                    continue
                row = timing_row(a, arm, link, (a.dir / "timing" / link / f"{arm}{a.shape.label}-r{rep}").resolve(), rep)
                if row is None:
                    ok = False
                    continue
                rows.append(row)
                write_json_atomic(path, rows)
    return ok


def _validate_suffix(a: argparse.Namespace, link: str) -> str:
    return f"{a.shape.label}-{link}" + ("" if a.validate_steps is None else f"-{a.validate_steps}steps")


def _validate_dir(a: argparse.Namespace, arm: str, link: str) -> Path:
    return (a.dir / "validate" / f"{arm}{_validate_suffix(a, link)}").resolve()


def _bracket_path(a: argparse.Namespace, arm: str, link: str) -> Path:
    return a.dir / "validate" / f"{arm}{_validate_suffix(a, link)}.bracket.json"


def _time_bracket(a: argparse.Namespace, arm: str, link: str, side: str, bracket: dict) -> bool:
    """Fill ``bracket[side]`` up to ``--validate-bracket`` timing runs of the arm, saved after each.
    They time the ``--bracket-steps`` after ``--bracket-skip``: the steady state a long run spends
    its steps in, not the start-up the study's short timing windows sit in."""
    timed = argparse.Namespace(**(vars(a) | {"skip": a.bracket_skip, "steps": a.bracket_steps}))
    ok = True
    for i in range(len(bracket[side]), a.validate_bracket):
        run_dir = (a.dir / "validate" / "bracket" / f"{arm}{_validate_suffix(a, link)}-{side}-r{i}").resolve()
        row = timing_row(timed, arm, link, run_dir, i)
        if row is None:
            ok = False
            break
        bracket[side].append(row | {"side": side})
        path = _bracket_path(a, arm, link)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, bracket)
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
            summary = json.loads((run_dir / "summary.json").read_text())
            # the recipe's metric, as its curve records have it (the GPT's validation loss, not accuracy)
            record = records.curve_record(arm, a.seeds[0], ARMS[arm], a.recipe, summary, records.read_segments(run_dir),
                                          metric=metric_for(a.recipe))
            a.records.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, record | {"kind": "validate", "link": link, "steps_limit": a.validate_steps,
                                              "bracket": bracket, **tta_shape.run_shape(summary)})
    return ok


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
