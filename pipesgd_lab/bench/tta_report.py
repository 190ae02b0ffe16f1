"""The time-to-accuracy report (``--phase report``): finished curve records composed with the
timing records into the result JSON, its plot, and the validation rows (composed against measured,
each against its own bracket of timing runs where it has one)."""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

from pipesgd.reliability.checkpoint import CheckpointDir, CheckpointError
from pipesgd.observability.hostinfo import fingerprint, host_kind
from pipesgd.observability.runinfo import git_commit, write_json_atomic

from . import probe
from . import tta_compose as compose
from . import tta_records as records
from .tta_arms import ARMS, metric_for, sync_every
from .tta_shape import run_shape

log = logging.getLogger("pipesgd_lab.bench.tta")


def write_curve_record(a: argparse.Namespace, arm: str, seed: int, run_dir: Path) -> dict | None:
    """The run's record in ``--records`` from its summary.json and segments (None if it has no
    summary yet): what the report uses, small enough to commit when the run ends. A run named in
    ``--stamp-host`` whose summary has no host gets this one's, marked as stamped."""
    summary = run_dir / "summary.json"
    if not summary.exists():
        return None
    path = records.record_path(a.records, arm, seed, shape=a.shape.label)
    stamp = fingerprint() if f"{arm}-s{seed}" in a.stamp_host else None
    ran = json.loads(summary.read_text())
    record = records.curve_record(arm, seed, ARMS[arm], a.recipe, ran, records.read_segments(run_dir), stamp,
                                  metric_for(a.recipe)) | run_shape(ran)
    old = json.loads(path.read_text()) if path.exists() else {}
    if record["host"] is None and str(old.get("host_source") or "").startswith(records.STAMPED):
        # refreshed later without --stamp-host: the stamp made when the run ended still holds
        record |= {k: old[k] for k in ("host", "host_source", "host_kind")}
    a.records.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, record)
    return record


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
            run_dir = a.dir / "runs" / f"{arm}{a.shape.label}-s{seed}"
            record = write_curve_record(a, arm, seed, run_dir)
            path = records.record_path(a.records, arm, seed, shape=a.shape.label)
            if record is None and path.exists():
                record = json.loads(path.read_text())
            if record is not None and not a.shape.holds(record):
                raise records.Refused(f"{path} ran as {_shape_of(record)}, this study as {a.shape.describe()} "
                                      "(--workers, --ranks-per-replica): report it apart")
            if record is not None:
                found[(arm, seed)] = record
                continue
            curve = _checkpoint_curve(run_dir)
            missing.append({"arm": arm, "seed": seed, "complete": False, "curve": curve or [],
                            "why_incomplete": "running or stopped: checkpoints only" if curve is not None
                            else "no run"})
    used, unfinished = records.usable_curves(found)
    return used, unfinished + missing


def _shape_of(record: dict) -> str:
    return f"{record.get('replicas') or '?'} replica(s) of {record.get('ranks_per_replica', 1)} rank(s)"


def timing_path(a: argparse.Namespace) -> Path:
    """The timing phase's file: ``<dir>/timing.json``, ``timing-<M>x<k>.json`` for several ranks per replica."""
    return a.dir / f"timing{a.shape.label}.json"


def study_overrides(a: argparse.Namespace) -> list[str]:
    """The overrides every run of the study was given beside the arm's: the user's, then the shape's."""
    return [*a.overrides, *a.shape.overrides()]


def check_shape(rows: list[dict], a: argparse.Namespace, where: str) -> list[dict]:
    """``rows`` (timing rows), :class:`records.Refused` if one ran in another shape than the study's."""
    other = next((r for r in rows if not a.shape.holds(r)), None)
    if other is not None:
        raise records.Refused(f"{where}: timing record {other['link']} {other['arm']} round {other['repeat']} ran as "
                              f"{_shape_of(other)}, this study as {a.shape.describe()}: report it apart")
    return rows


def load_timing(a: argparse.Namespace) -> dict[str, dict]:
    path = a.timing if a.timing is not None else timing_path(a)
    if not path.exists():
        return {}
    rows = check_shape(json.loads(path.read_text()), a, str(path))
    return timing_by_link(records.check_timing(rows, a.recipe, ARMS, study_overrides(a)))


def timing_by_link(rows: list[dict]) -> dict[str, dict]:
    """Per link: each arm's median ms/step pooled over repeats (with the repeats' medians as the
    spread), the median evaluation time over every run on that link, the steps each arm's runs timed
    (``windows``), and the runs' commits and dates."""
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
        block.setdefault("rows", []).append(r)
        block.setdefault("hosts", set()).add(host_kind(r.get("host")))
        block.setdefault("mtu", set()).add(records.link_mtu(r["command"]))
        block.setdefault("dates", []).append(r.get("date"))
        window = records.timing_window(r)
        block.setdefault("windows", {}).setdefault(r["arm"], set()).add((window["first"], window["steps"]))
    return {link: {"windows": {arm: [{"first": f, "steps": n} for f, n in sorted(w, key=str)]
                               for arm, w in b["windows"].items()},
                   "step_ms": {arm: _step_ms(arm, v) for arm, v in b["pooled"].items()},
                   "warmup_ms": {arm: statistics.median(v) for arm, v in b.get("warmup", {}).items()},
                   "repeat_median_ms": b["repeat_medians"], "eval_s": statistics.median(b["eval_s"]),
                   "cpu": b["cpu"], "commits": sorted({c for c in b["runs"] if c}), "mtu": _one_mtu(link, b["mtu"]),
                   "hosts": sorted(b["hosts"]), "host_speed": probe.summary(b["rows"]),
                   "measured": [min(d for d in b["dates"] if d), max(d for d in b["dates"] if d)]}
            for link, b in out.items()}


def _step_ms(arm: str, iter_ms: list[float]) -> float:
    """An arm's ms per step: the median step; for an arm of rounds (trainer.sync_every = H > 1, whose
    timing windows are whole rounds) the mean, so each round's exchange step counts once per H."""
    return statistics.fmean(iter_ms) if arm in ARMS and sync_every(arm) > 1 else statistics.median(iter_ms)


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


def _run_row(r: dict, targets: dict[str, float], metric: compose.Metric = compose.ACCURACY) -> dict:
    final = f"final_{metric.key}"
    row = {"name": r["arm"], "seed": r["seed"], "complete": r["complete"], "curve": r["curve"],
           final: r.get(final) if r["complete"] else None}
    if r["complete"]:
        row |= {"steps_to_target": (compose.steps_to(r["curve"], targets["target"], metric) or (None,))[0],
                "crossings": compose.crossings(r["curve"], targets, metric), "segments": r.get("segments", []),
                "git_commit_at_end": r.get("git_commit_at_end"), "config_digest": r.get("config_digest"),
                "host_kind": r.get("host_kind") or host_kind(r.get("host"))}
        if r.get("provenance"):
            row["provenance"] = r["provenance"]
    else:
        row["why_incomplete"] = r.get("why_incomplete")
    return row


def _own_timing(v: dict, rows: list[dict], warmup_at: dict[str, str]) -> dict | None:
    """Step, warm-up and evaluation time of a validation record's arm from its (checked) bracket
    timing ``rows`` (None if they cannot price it)."""
    block = timing_by_link(rows).get(v["link"])
    if block is None or v["arm"] not in block["step_ms"]:
        return None
    warm = compose.warmup_rate(v["arm"], block["step_ms"], warmup_at, block["warmup_ms"])
    return {"step_ms": block["step_ms"][v["arm"]], "eval_s": block["eval_s"], "warmup_ms": warm}


def _validation_folder(a: argparse.Namespace) -> Path:
    """Where the validation records are read: ``--validations``, else ``--records``."""
    return a.validations or a.records


def _validation(a: argparse.Namespace, links: dict, target: float, warmup: dict[str, int],
                used: list[dict], warmup_at: dict[str, str] | None = None) -> list[dict]:
    """Composed against measured, from the validation records of the arms and links timed. A record
    with a bracket (timing runs just before and after it) is composed against that bracket, with the
    before-only and after-only compositions beside it as the drift's range; one without, against
    the report's timing (``timing``: which)."""
    warmup_at = warmup_at or {}
    rows = []
    folder = _validation_folder(a)
    for path in sorted(folder.glob("validate-*.json")) if folder.is_dir() else []:
        v = json.loads(path.read_text())
        link, arm = v["link"], v["arm"]
        if v["recipe"] != a.recipe or not a.shape.holds(v):  # another study's, named apart
            continue
        limit = v.get("steps_limit")
        bracket = v.get("bracket") or {}
        sides = {side: bracket.get(side) or [] for side in ("before", "after")}
        if sides["before"] and sides["after"]:
            records.check_timing(check_shape(sides["before"] + sides["after"], a, path.name), a.recipe, ARMS,
                                 study_overrides(a))
            own = _own_timing(v, sides["before"] + sides["after"], warmup_at)
            ranges = [_own_timing(v, sides[side], warmup_at) for side in ("before", "after")]
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
                                          t["step_ms"], t["eval_s"], warmup.get(arm, 0), t["warmup_ms"],
                                          metric_for(a.recipe))
        row = composed(own) | {"timing": timing, "step_ms": own["step_ms"], "warmup_ms": own["warmup_ms"],
                               "eval_s": own["eval_s"]}
        if timing == "bracket":  # which steps the bracket timed: the goal judges steady-state windows
            row["window"] = records.timing_window(sides["before"][0])
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


OTHER_ACCOUNTINGS = tuple(a for a in compose.ACCOUNTINGS if a != compose.HEADLINE_ACCOUNTING)
"""Accountings composed beside the headline (each link's ``accountings``)."""


def build_result(a: argparse.Namespace, used: list[dict], unfinished: list[dict], timing: dict[str, dict]) -> dict:
    hosts = records.seed_hosts(used, a.mixed_hosts)
    finished = [{"name": r["arm"], "seed": r["seed"], "curve": r["curve"]} for r in used]
    metric = metric_for(a.recipe)
    targets = metric.targets([r[f"final_{metric.key}"] for r in used if r["arm"] == "sync"])
    warm = {r["arm"]: _warmup(r) for r in used}
    warmup = {arm: steps for arm, (steps, _) in warm.items()}
    warmup_at = {arm: at for arm, (_, at) in warm.items() if at}
    links = {}
    for link, t in timing.items():
        block, *others = (compose.compose_link(finished, t["step_ms"], t["eval_s"], warmup, targets, warmup_at,
                                               t.get("warmup_ms"), accounting, metric)
                          for accounting in (compose.HEADLINE_ACCOUNTING, *OTHER_ACCOUNTINGS))
        block["accountings"] = {o["accounting"]: {k: v for k, v in o.items() if k not in ("step_ms", "eval_s")}
                                for o in others}
        block["speedup_range"] = compose.speedup_ranges(block, finished, t["repeat_median_ms"], warmup, warmup_at,
                                                        t.get("warmup_ms"), metric)
        links[link] = block | {"repeat_median_ms": t["repeat_median_ms"], "cpu": t["cpu"],
                               "ceiling": compose.link_ceiling(block), "timing_commits": t["commits"],
                               "timing_measured": t["measured"], "link_mtu": t["mtu"], "timing_windows": t["windows"],
                               "timing_hosts": t["hosts"], "timing_host_speed": t.get("host_speed")}
    reference = next((r for r in used if r["arm"] == "sync"), used[0] if used else None)
    result = {
        "recipe": {"experiment": a.recipe, "arms": {arm: list(ARMS[arm]) for arm in a.arms},
                   "overrides": study_overrides(a),
                   "config": None if reference is None else records.recipe_config(
                       reference["config"], {k for arm in a.arms for k in records.override_keys(ARMS[arm])},
                       reference.get("world_size"))},
        "target_accuracy": targets["target"], "same_accuracy_pp": compose.SAME_ACCURACY_PP,
        "targets": targets,
        "warmup": {arm: {"steps": n, "at": warmup_at.get(arm)} for arm, n in warmup.items()},
        "warmup_accounting": {"headline": compose.HEADLINE_ACCOUNTING, "also": list(OTHER_ACCOUNTINGS),
                              "meaning": dict(compose.ACCOUNTINGS)},
        "hosts": hosts, "mixed_hosts_allowed": bool(a.mixed_hosts),
        "metric": {"key": metric.key, "lower_is_better": metric.lower_is_better, "unit": metric.unit},
        "arms": [_run_row(r, targets, metric) for r in used] + [_run_row(r, targets, metric) for r in unfinished],
        "links": links, "validation": _validation(a, links, targets["target"], warmup, used, warmup_at),
        "validation_folder": str(_validation_folder(a)),
        # what the timing runs did is in their rows (links: timing_windows, repeat_median_ms), not in
        # this invocation's --steps/--skip
        "timing_config": {"workers": a.workers},
        # one rank per replica: the result as it always was (committed results recompose unchanged)
        **({"shape": a.shape.fields() | {"world_size": a.shape.world}} if a.shape.ranks_per_replica > 1 else {}),
        "commit": git_commit(), "date": records.now(),
    }
    return result | {"goals": compose.goals(result)}


def plot(result: dict, path: Path) -> None:
    """Test accuracy against wall-clock seconds on the first link, one curve per arm (its first seed)."""
    from pipesgd_lab.report.figure import new_figure

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
                lw=1.6 if compose.pipelined(arm) else 1.1)
    _metric_axis(ax, result)
    ax.set_xlabel(f"wall-clock minutes at {link} (composed: steps × measured ms/step + evaluations)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right" if result["metric"]["lower_is_better"] else "lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def _metric_axis(ax, result: dict) -> None:
    """The study's metric on ``ax``'s y axis: its label, the target as a dashed line, and limits
    that show the end of the curves, where the arms differ."""
    metric, target = result["metric"], result["target_accuracy"]
    ax.axhline(target, color="0.4", ls="--", lw=0.8)
    ax.text(0.01, target, f"target {target:.4g} {metric['unit']}".rstrip(), fontsize=8,
            va="top" if metric["lower_is_better"] else "bottom", transform=ax.get_yaxis_transform())
    ax.set_ylabel(f"{metric['key'].replace('_', ' ')} ({metric['unit']})" if metric["unit"] else
                  metric["key"].replace("_", " "))
    curves = [r["curve"] for r in result["arms"] if r["complete"] and r["curve"]]
    if metric["lower_is_better"]:  # the early evaluations would flatten the end
        finals = [c[-1][1] for c in curves]
        if finals:
            ax.set_ylim(min(finals + [target]) * 0.97, max(finals) * 1.6)
    else:
        top = max((v for c in curves for _, v in c), default=100)
        ax.set_ylim(max(0, top - 25), min(100, top + 2))


def plot_steps(result: dict, path: Path) -> None:
    """The metric against training step, every complete run (an arm's seeds in its colour), and
    the target: the plot a study has before any timing prices its steps."""
    from pipesgd_lab.report.figure import new_figure

    metric = result["metric"]
    fig = new_figure(7.5, 4.5)
    ax = fig.add_subplot()
    colours: dict[str, str] = {}
    for run in result["arms"]:
        if not run["complete"]:
            continue
        arm = run["name"]
        label = None if arm in colours else arm
        colours.setdefault(arm, f"C{len(colours) % 10}")
        steps, values = zip(*run["curve"]) if run["curve"] else ((), ())
        ax.plot(steps, values, color=colours[arm], label=label, lw=1.6 if compose.pipelined(arm) else 1.1,
                alpha=0.9 if run["seed"] == 0 else 0.55)
    _metric_axis(ax, result)
    ax.set_xlabel("training step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right" if metric["lower_is_better"] else "lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def host_speed_lines(result: dict) -> list[str]:
    """One line per link whose timing rows carry host-speed probes: the probes' median and range,
    and the runs the host moved under (more than :data:`probe.MOVED` during a run, or apart from
    the median), which a reader should not trust beside the others."""
    lines = []
    for link, block in result["links"].items():
        speed = block.get("timing_host_speed")
        if not speed:
            continue
        low, high = speed["range_gflops"]
        moved = ", ".join(f"{m['arm']} r{m['repeat']} ({m['before']:.1f} -> {m['after']:.1f})" for m in speed["moved"])
        lines.append(f"host speed on {link}: median {speed['median_gflops']:.1f} GFLOP/s over {speed['runs']} timing "
                     f"runs (range {low:.1f}-{high:.1f}); "
                     + (f"moved by more than {speed['moved_threshold']:.0%} under {len(speed['moved'])}: {moved}"
                        if moved else f"no run moved by more than {speed['moved_threshold']:.0%}"))
    return lines


def report(a: argparse.Namespace) -> dict:
    used, unfinished = load_runs(a)
    for r in unfinished:
        log.warning("not used: %s seed %d (%s)", r["arm"], r["seed"], r.get("why_incomplete"))
    result = build_result(a, used, unfinished, load_timing(a))
    a.json.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(a.json, result)
    if str(a.plot) not in ("", "."):  # priced by the timing if there is one, else against the step
        (plot if result["links"] else plot_steps)(result, a.plot)
    print(compose.table(result))
    print(compose.accounting_table(result))
    for line in host_speed_lines(result):
        print(line)
    print(compose.goals_table(result["goals"]))
    return result
