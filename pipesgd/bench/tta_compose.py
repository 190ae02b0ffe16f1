"""Time to accuracy, composed: accuracy against steps (from full-length runs) times seconds per step
(from short timed runs on each link) plus evaluation time. Pure arithmetic on plain data, no torch.

A fixed-staleness run's accuracy does not depend on timing, so a curve measured on loopback holds
on any link; only the step time differs. For arm ``a`` on link ``l``, the wall-clock time at the
evaluation after step ``s`` (the ``i``-th evaluation of the run) is::

    t(s) = min(s, w) * sync_ms[l] + max(0, s - w) * step_ms[a, l] + i * eval_s[l]

with ``w`` the arm's synchronous warm-up steps (charged at the ``sync`` arm's step time).
Accuracies here are in percent.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

SAME_ACCURACY_PP = 0.3
"""The target is the ``sync`` arm's mean final accuracy minus this many points ("the same accuracy")."""
FIXED_TARGETS = (85.0, 90.0)
BASELINES = ("sync", "ddp", "ddp-fp16")


def target_accuracy(finals: Sequence[float], slack_pp: float = SAME_ACCURACY_PP) -> float:
    """The mean final accuracy of the reference runs minus ``slack_pp``; ValueError without runs."""
    if not finals:
        raise ValueError("no finished 'sync' run to set the target from: run the sync arm first (--arms sync)")
    return statistics.fmean(finals) - slack_pp


def steps_to(curve: Sequence[Sequence[float]], target: float) -> tuple[int, int] | None:
    """(step, number of evaluations up to and including it) of the first evaluation at or above
    ``target``; None if the curve never gets there. ``curve`` is ``[[step, accuracy], ...]``."""
    for i, (step, acc) in enumerate(curve, 1):
        if acc >= target:
            return int(step), i
    return None


def train_seconds(steps: int, step_ms: float, warmup_steps: int = 0, warmup_ms: float | None = None) -> float:
    """Seconds of training for ``steps`` steps, the first ``warmup_steps`` at ``warmup_ms`` each."""
    w = min(steps, warmup_steps)
    return (w * (step_ms if warmup_ms is None else warmup_ms) + (steps - w) * step_ms) / 1e3


def time_to(curve: Sequence[Sequence[float]], target: float, step_ms: float, eval_s: float,
            warmup_steps: int = 0, warmup_ms: float | None = None) -> float | None:
    """Composed wall-clock seconds to the first evaluation at or above ``target`` (None: never)."""
    hit = steps_to(curve, target)
    if hit is None:
        return None
    step, evals = hit
    return train_seconds(step, step_ms, warmup_steps, warmup_ms) + evals * eval_s


def wall_curve(curve: Sequence[Sequence[float]], step_ms: float, eval_s: float, warmup_steps: int = 0,
               warmup_ms: float | None = None) -> list[list[float]]:
    """``[[seconds, accuracy], ...]``: the curve on a link's clock."""
    return [[train_seconds(int(s), step_ms, warmup_steps, warmup_ms) + i * eval_s, a]
            for i, (s, a) in enumerate(curve, 1)]


def _mean_or_none(xs: Sequence[float | None]) -> float | None:
    """The mean, or None if any seed did not get there (a partial mean would flatter the arm)."""
    return None if not xs or any(x is None for x in xs) else statistics.fmean(xs)


def compose_link(runs: Sequence[dict], step_ms: dict[str, float], eval_s: float, warmup: dict[str, int],
                 target: float) -> dict:
    """One link's block of the result: step time, time to target (and to each of
    :data:`FIXED_TARGETS`) per arm, mean over the arm's seeds, and speedups against the baselines.

    ``runs`` are finished runs ``{"name", "seed", "curve"}``; arms without a measured step time
    are left out. ``warmup[arm]`` is its synchronous warm-up steps (charged at ``step_ms["sync"]``).
    """
    sync_ms = step_ms.get("sync")
    out: dict = {"step_ms": dict(step_ms), "eval_s": eval_s, "time_to_target_s": {}}
    for fixed in FIXED_TARGETS:
        out[f"time_to_{fixed:g}_s"] = {}
    by_arm: dict[str, list[dict]] = {}
    for r in runs:
        by_arm.setdefault(r["name"], []).append(r)
    for arm, rs in by_arm.items():
        if arm not in step_ms:
            continue
        w = warmup.get(arm, 0) if sync_ms is not None else 0

        def mean_time(t: float) -> float | None:
            return _mean_or_none([time_to(r["curve"], t, step_ms[arm], eval_s, w, sync_ms) for r in rs])

        out["time_to_target_s"][arm] = mean_time(target)
        for fixed in FIXED_TARGETS:
            out[f"time_to_{fixed:g}_s"][arm] = mean_time(fixed)
    times = out["time_to_target_s"]
    out["speedup"] = {base: {arm: (times[base] / t if t and times.get(base) else None) for arm, t in times.items()}
                      for base in BASELINES if base in times}
    return out


def arm_summary(runs: Sequence[dict], target: float) -> list[dict]:
    """Per arm, in first-seen order: seeds, mean final accuracy and half-range, steps to target."""
    by_arm: dict[str, list[dict]] = {}
    for r in runs:
        by_arm.setdefault(r["name"], []).append(r)
    rows = []
    for arm, rs in by_arm.items():
        finals = [r["final_test_accuracy"] for r in rs]
        hits = [steps_to(r["curve"], target) for r in rs]
        rows.append({"name": arm, "seeds": [r["seed"] for r in rs], "final_mean": statistics.fmean(finals),
                     "final_half_range": (max(finals) - min(finals)) / 2, "finals": finals,
                     "steps_to_target": _mean_or_none([None if h is None else h[0] for h in hits])})
    return rows


def validation_row(arm: str, link: str, curve: Sequence[Sequence[float]], measured_elapsed: Sequence[float],
                   target: float | None, step_ms: float, eval_s: float, warmup_steps: int = 0,
                   warmup_ms: float | None = None) -> dict:
    """Composed against measured seconds to ``target`` for a run timed end to end on ``link``:
    ``measured_elapsed[i]`` is the run's own clock at its ``i``-th evaluation (fit start to the
    end of that evaluation). ``target=None`` compares at the run's last evaluation instead (a
    shortened validation run that stops before the target)."""
    if target is None:
        hit = (int(curve[-1][0]), len(curve)) if curve else None
    else:
        hit = steps_to(curve, target)
    composed = None if hit is None else train_seconds(hit[0], step_ms, warmup_steps, warmup_ms) + hit[1] * eval_s
    measured = None if hit is None else measured_elapsed[hit[1] - 1]
    return {"arm": arm, "link": link, "at_step": None if hit is None else hit[0], "composed_s": composed,
            "measured_s": measured,
            "rel_error": None if composed is None or not measured else (composed - measured) / measured}


def table(result: dict) -> str:
    """The Markdown table of docs/time-to-accuracy.md: one row per arm."""
    target = result["target_accuracy"]
    links = list(result["links"])
    head = ["arm", "seeds", "final test acc %", f"steps to {target:.2f} %"]
    for link in links:
        head += [f"ms/step {link}", f"time to target {link}", f"vs sync / ddp / ddp-fp16 {link}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in arm_summary(result["arms"], target):
        arm = row["name"]
        spread = f" ± {row['final_half_range']:.2f}" if len(row["seeds"]) > 1 else ""
        steps = row["steps_to_target"]
        cells = [arm, str(len(row["seeds"])), f"{row['final_mean']:.2f}{spread}",
                 "not reached" if steps is None else f"{steps:.0f}"]
        for link in links:
            block = result["links"][link]
            ms, t = block["step_ms"].get(arm), block["time_to_target_s"].get(arm)
            ups = [block.get("speedup", {}).get(b, {}).get(arm) for b in BASELINES]
            cells += ["–" if ms is None else f"{ms:.0f}", "–" if t is None else f"{t / 60:.1f} min",
                      " / ".join("–" if u is None else f"{u:.2f}×" for u in ups)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
