"""Time to accuracy, composed: accuracy against steps (from full-length runs) times seconds per step
(from short timed runs on each link) plus evaluation time. Pure arithmetic on plain data, no torch.

A fixed-staleness run's accuracy does not depend on timing, so a curve measured on loopback holds
on any link; only the step time differs. For arm ``a`` on link ``l``, the wall-clock time at the
evaluation after step ``s`` (the ``i``-th evaluation of the run) is::

    t(s) = min(s, w) * sync_ms[l] + max(0, s - w) * step_ms[a, l] + i * eval_s[l]

with ``w`` the arm's warm-up steps (a pipe arm's synchronous steps, the plain allreduce steps
torch's PowerSGD hook takes before it compresses) and ``sync_ms`` their price, in one of two
accountings (:data:`ACCOUNTINGS`): ``own_rate`` (the headline) charges them at the rate the arm's
own timing run measured them running at, or, where it did not time them, at the arm's own step
time; ``other_arm_rate`` (the reports up to 2026-11-27) charges them at the step time of the arm
that runs such steps plainly: ``sync`` for a pipe arm, ``ddp`` for the PowerSGD hook.
Accuracies here are in percent.
A recipe may compare a lower-is-better metric instead (a language
model's validation loss): :class:`Metric` says which field, its direction and its headline target,
and every "reaches the target" below goes through :meth:`Metric.reaches`.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SAME_ACCURACY_PP = 0.3
"""The target is the ``sync`` arm's mean final accuracy minus this many points ("the same accuracy")."""
FIXED_TARGETS = (85.0, 90.0)
SLACKS_PP = (0.1, 0.3, 0.5)
SWEEP_FIXED = 85.0
"""The fixed accuracy the sweep also reports (90 % is reported, but no arm of the recipe reaches it)."""
"""The slack sweep: how much the speedups depend on the target rule fixed before the runs."""
DDP_ARMS = ("ddp", "ddp-fp16", "ddp-powersgd")


def pipelined(arm: str) -> bool:
    """An arm whose averaged gradient is applied a step late: pipe's (``pipe…``) and DDP with the
    pipelined hook (``ddp-pipelined…``, docs/ddp-hook.md); a DDP arm (:data:`DDP_ARMS`) is a baseline."""
    return arm.startswith(("pipe", "ddp-pipelined"))
BASELINES = ("sync", *DDP_ARMS)
COMPUTE_ARM = "compute"
"""The timing-only arm with no communication: the ceiling on this machine."""


SAME_LOSS_REL = 0.01
"""A lower-is-better target is the ``sync`` arm's mean final value times 1 + this ("the same loss")."""
LOSS_SLACKS_REL = (0.005, 0.01, 0.02)


@dataclass(frozen=True)
class Metric:
    """What a recipe's study compares: the summary.json field ``key`` (records keep it times
    ``scale``, as ``final_<key>`` and the curve), and its direction."""

    key: str
    scale: float = 1.0
    lower_is_better: bool = False
    unit: str = ""

    def reaches(self, value: float, target: float) -> bool:
        return value <= target if self.lower_is_better else value >= target

    def margin(self, value: float, target: float) -> float:
        """How far ``value`` is past ``target`` in the better direction (negative: short of it)."""
        return target - value if self.lower_is_better else value - target

    def gap(self, value: float, reference: float) -> float:
        """``value`` against the reference arm's: accuracy in points (negative: worse); a
        lower-is-better metric relative to the reference (positive: worse)."""
        return (value - reference) / reference if self.lower_is_better else value - reference

    @property
    def same(self) -> float:
        """The largest :meth:`gap` that still counts as "the same" (the headline target's rule)."""
        return SAME_LOSS_REL if self.lower_is_better else -SAME_ACCURACY_PP

    def is_same(self, value: float, reference: float) -> bool:
        gap = self.gap(value, reference)
        return gap <= self.same if self.lower_is_better else gap >= self.same

    @property
    def headline_slack(self) -> str:
        """The name of the sweep's target that equals the headline rule."""
        return f"slack {100 * SAME_LOSS_REL:g} %" if self.lower_is_better else f"slack {SAME_ACCURACY_PP:g}"

    def targets(self, finals: Sequence[float]) -> dict[str, float]:
        """The headline target from the reference (``sync``) runs' finals and the sweep around it:
        accuracy as :func:`targets_from`; a lower-is-better metric at ``mean * (1 + SAME_LOSS_REL)``,
        swept over ``LOSS_SLACKS_REL``."""
        if not self.lower_is_better:
            return targets_from(finals)
        if not finals:
            raise ValueError("no finished 'sync' run to set the target from: run the sync arm first (--arms sync)")
        mean = statistics.fmean(finals)
        return {"target": mean * (1 + SAME_LOSS_REL)} | {f"slack {100 * s:g} %": mean * (1 + s)
                                                          for s in LOSS_SLACKS_REL}


ACCURACY = Metric("test_accuracy", scale=100.0, unit="%")
LOSS = Metric("test_loss", lower_is_better=True, unit="nats")


def metric_of(result: Mapping) -> Metric:
    """The metric a study's result was composed for (results from before the field: accuracy)."""
    key = (result.get("metric") or {}).get("key", ACCURACY.key)
    return next(m for m in (ACCURACY, LOSS) if m.key == key)


def target_accuracy(finals: Sequence[float], slack_pp: float = SAME_ACCURACY_PP) -> float:
    """The mean final accuracy of the reference runs minus ``slack_pp``; ValueError without runs."""
    if not finals:
        raise ValueError("no finished 'sync' run to set the target from: run the sync arm first (--arms sync)")
    return statistics.fmean(finals) - slack_pp


def steps_to(curve: Sequence[Sequence[float]], target: float,
             metric: Metric = ACCURACY) -> tuple[int, int] | None:
    """(step, number of evaluations up to and including it) of the first evaluation that reaches
    ``target`` (at or above it; at or below for a lower-is-better ``metric``); None if the curve
    never gets there. ``curve`` is ``[[step, value], ...]``."""
    for i, (step, acc) in enumerate(curve, 1):
        if metric.reaches(acc, target):
            return int(step), i
    return None


def train_seconds(steps: int, step_ms: float, warmup_steps: int = 0, warmup_ms: float | None = None) -> float:
    """Seconds of training for ``steps`` steps, the first ``warmup_steps`` at ``warmup_ms`` each."""
    w = min(steps, warmup_steps)
    return (w * (step_ms if warmup_ms is None else warmup_ms) + (steps - w) * step_ms) / 1e3


def time_to(curve: Sequence[Sequence[float]], target: float, step_ms: float, eval_s: float,
            warmup_steps: int = 0, warmup_ms: float | None = None, metric: Metric = ACCURACY) -> float | None:
    """Composed wall-clock seconds to the first evaluation that reaches ``target`` (None: never)."""
    hit = steps_to(curve, target, metric)
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


def targets_from(finals: Sequence[float], slacks: Sequence[float] = SLACKS_PP,
                 fixed: Sequence[float] = FIXED_TARGETS) -> dict[str, float]:
    """``{"target": sync mean - SAME_ACCURACY_PP, "slack 0.1": ..., "85": 85.0, ...}``: the headline
    rule fixed before the runs, the slack sweep around it, and the fixed accuracies."""
    out = {"target": target_accuracy(finals)}
    out |= {f"slack {s:g}": target_accuracy(finals, s) for s in slacks}
    return out | {f"{f:g}": float(f) for f in fixed}


OWN_RATE = "own_rate"
OTHER_ARM_RATE = "other_arm_rate"
ACCOUNTINGS = {
    OWN_RATE: "each arm's warm-up at the rate its own timing run measured it running at (where a timing "
              "run did not time it: at the arm's own step time)",
    OTHER_ARM_RATE: "each arm's warm-up at the step time of the arm that runs such steps plainly "
                    "(sync for a pipe arm's synchronous steps, ddp for the PowerSGD hook's plain allreduce steps)",
}
"""How warm-up steps are priced; the report composes both, the headline with :data:`HEADLINE_ACCOUNTING`."""
HEADLINE_ACCOUNTING = OWN_RATE


def warmup_rate(arm: str, step_ms: dict[str, float], warmup_at: dict[str, str] | None = None,
                warmup_ms: dict[str, float] | None = None, accounting: str = OWN_RATE) -> float | None:
    """ms per warm-up step of ``arm`` in ``accounting`` (:data:`ACCOUNTINGS`): ``own_rate``, its
    warm-up's measured rate (``warmup_ms``), else its own step time; ``other_arm_rate``, the step
    time of the arm that runs such steps (``warmup_at``, default ``sync``). None if not known."""
    if accounting not in ACCOUNTINGS:
        raise ValueError(f"accounting={accounting!r} is not one of {', '.join(ACCOUNTINGS)}")
    if accounting == OTHER_ARM_RATE:
        return step_ms.get((warmup_at or {}).get(arm, "sync"))
    return warmup_ms[arm] if warmup_ms and arm in warmup_ms else step_ms.get(arm)


def warmup_source(arm: str, warmup_at: dict[str, str] | None, warmup_ms: dict[str, float] | None,
                  accounting: str) -> str:
    """Where :func:`warmup_rate`'s rate comes from, for the JSON."""
    if accounting == OTHER_ARM_RATE:
        return f"{(warmup_at or {}).get(arm, 'sync')} step time"
    return "timed warm-up" if warmup_ms and arm in warmup_ms else "own step time (warm-up not timed)"


def compose_link(runs: Sequence[dict], step_ms: dict[str, float], eval_s: float, warmup: dict[str, int],
                 targets: dict[str, float] | float, warmup_at: dict[str, str] | None = None,
                 warmup_ms: dict[str, float] | None = None, accounting: str = HEADLINE_ACCOUNTING,
                 metric: Metric = ACCURACY) -> dict:
    """One link's block of the result: per target (a float is ``{"target": it}``), each arm's time
    (the mean over its seeds) and the speedups against every baseline arm that has one, including
    the fastest DDP arm (``best ddp``).

    ``runs`` are finished runs ``{"name", "seed", "curve"}``; arms without a step time are left out.
    ``warmup[arm]`` warm-up steps are charged at :func:`warmup_rate` in ``accounting``
    (``warmup_source`` says where each rate came from); without one such an arm is not priced at all
    (``unpriced`` says why).
    """
    if not isinstance(targets, dict):
        targets = {"target": float(targets)}
    warmup_at = warmup_at or {}
    out: dict = {"step_ms": dict(step_ms), "eval_s": eval_s, "accounting": accounting, "unpriced": {}, "targets": {},
                 "warmup_ms": {}, "warmup_source": {}}
    by_arm: dict[str, list[dict]] = {}
    for r in runs:
        by_arm.setdefault(r["name"], []).append(r)
    priced = {}
    for arm, rs in by_arm.items():
        if arm not in step_ms:
            continue
        rate = warmup_rate(arm, step_ms, warmup_at, warmup_ms, accounting)
        if warmup.get(arm, 0) and rate is None:
            out["unpriced"][arm] = (f"its {warmup[arm]} warm-up steps need the {warmup_at.get(arm, 'sync')} arm's "
                                    "step time, which this link has not measured")
            continue
        if warmup.get(arm, 0):
            out["warmup_ms"][arm] = rate
            out["warmup_source"][arm] = warmup_source(arm, warmup_at, warmup_ms, accounting)
        priced[arm] = rs
    for name, accuracy in targets.items():
        times = {arm: _mean_or_none([time_to(r["curve"], accuracy, step_ms[arm], eval_s, warmup.get(arm, 0),
                                             out["warmup_ms"].get(arm), metric) for r in rs])
                 for arm, rs in priced.items()}
        ddp = {arm: t for arm, t in times.items() if arm in DDP_ARMS and t}
        block = {"accuracy": accuracy, "time_s": times, "best_ddp": min(ddp, key=ddp.get) if ddp else None}
        bases = {base: times[base] for base in BASELINES if times.get(base)}
        if block["best_ddp"]:
            bases["best ddp"] = ddp[block["best_ddp"]]
        block["speedup"] = {base: {arm: (t_base / t if t else None) for arm, t in times.items()}
                            for base, t_base in bases.items()}
        out["targets"][name] = block
    if "target" in out["targets"]:  # the headline rule, also under the names earlier reports used
        out["time_to_target_s"] = out["targets"]["target"]["time_s"]
        out["speedup"] = out["targets"]["target"]["speedup"]
    return out


def verdict(low: float, high: float) -> str:
    """``sooner`` if every combination is faster, ``later`` if every one is slower, else ``tie``:
    a ratio whose range includes 1.0 is not a win."""
    return "sooner" if low > 1 else "later" if high < 1 else "tie"


def speedup_ranges(block: dict, runs: Sequence[dict], round_ms: dict[str, list[float]], warmup: dict[str, int],
                   warmup_at: dict[str, str] | None = None, warmup_ms: dict[str, float] | None = None,
                   metric: Metric = ACCURACY) -> dict:
    """Per baseline (:data:`BASELINES` and ``best ddp``) and arm of a composed link ``block`` at its headline
    target: ``range`` [low, high] of the baseline's time over the arm's across every pairing of a
    seed of each and every timing round (both priced at that round's median step, in the block's
    accounting), and its :func:`verdict`. ``round_ms[arm]``: the arm's per-round medians, rounds
    in the same order for every arm (they interleave). Pairs where a seed never reaches the target
    are left out; an arm with none left has no range."""
    head = block["targets"].get("target")
    if head is None:
        return {}
    n = min((len(v) for v in round_ms.values()), default=0)
    by_arm: dict[str, list[dict]] = {}
    for r in runs:
        by_arm.setdefault(r["name"], []).append(r)

    def times(arm: str, i: int) -> list[float]:
        ms = {a: v[i] for a, v in round_ms.items()}
        rate = warmup_rate(arm, ms, warmup_at, warmup_ms, block["accounting"])
        got = [time_to(r["curve"], head["accuracy"], ms[arm], block["eval_s"], warmup.get(arm, 0), rate, metric)
               for r in by_arm[arm]]
        return [t for t in got if t]

    out: dict = {}
    bases = {b: b for b in BASELINES} | ({"best ddp": head["best_ddp"]} if head["best_ddp"] else {})
    for name, base in bases.items():
        for arm in head["time_s"]:
            if base not in by_arm or arm == base or arm not in round_ms or base not in round_ms or not n:
                continue
            ratios = [tb / ta for i in range(n) for tb in times(base, i) for ta in times(arm, i)]
            if ratios:
                out.setdefault(name, {})[arm] = {"range": [min(ratios), max(ratios)],
                                                 "verdict": verdict(min(ratios), max(ratios))}
    return out


def ceiling(step_ms: dict[str, float]) -> dict | None:
    """What compute alone allows on a link: the fastest DDP arm's step time against the ``compute``
    arm's (no communication), and per pipe arm the fraction of that gap it closes
    (``captured`` = (ddp − arm) / (ddp − compute)). None without a compute time; the DDP fields are
    None without a DDP arm's."""
    compute = step_ms.get(COMPUTE_ARM)
    ddp = {arm: ms for arm, ms in step_ms.items() if arm in DDP_ARMS}
    if compute is None:
        return None
    if not ddp:
        return {"compute_ms": compute, "best_ddp": None, "best_ddp_ms": None, "ceiling_speedup": None, "captured": {}}
    best = min(ddp, key=ddp.get)
    gap = ddp[best] - compute
    return {"compute_ms": compute, "best_ddp": best, "best_ddp_ms": ddp[best],
            "ceiling_speedup": ddp[best] / compute if compute else None,
            "captured": {arm: ((ddp[best] - ms) / gap if gap > 0 else None)
                         for arm, ms in step_ms.items() if pipelined(arm)}}


def link_ceiling(block: dict) -> dict | None:
    """:func:`ceiling` of a composed link block, leaving out the DDP arms whose curve never reaches
    the target (listed in ``ddp_arms_never_at_target``): a fast step that never gets there is no
    rival in time to accuracy. The goal, the JSON and the table all read this one ceiling."""
    never = sorted(arm for arm, t in block.get("time_to_target_s", {}).items() if arm in DDP_ARMS and t is None)
    cap = ceiling({arm: ms for arm, ms in block["step_ms"].items() if arm not in never})
    return None if cap is None else cap | {"ddp_arms_never_at_target": never}


def crossings(curve: Sequence[Sequence[float]], targets: dict[str, float],
              metric: Metric = ACCURACY) -> dict[str, dict | None]:
    """Per target: the step where the curve first reaches it and the margin (how far past the
    target the value there is, in the metric's units: pp for accuracy): how close a seed came to
    not counting. None where it never does."""
    out = {}
    for name, accuracy in targets.items():
        hit = steps_to(curve, accuracy, metric)
        out[name] = None if hit is None else {"step": hit[0],
                                              "margin_pp": metric.margin(curve[hit[1] - 1][1], accuracy)}
    return out


def arm_summary(runs: Sequence[dict], target: float, metric: Metric = ACCURACY) -> list[dict]:
    """Per arm, in first-seen order: seeds, mean final value of ``metric`` and half-range, steps to target."""
    by_arm: dict[str, list[dict]] = {}
    for r in runs:
        by_arm.setdefault(r["name"], []).append(r)
    rows = []
    for arm, rs in by_arm.items():
        finals = [r[f"final_{metric.key}"] for r in rs]
        hits = [steps_to(r["curve"], target, metric) for r in rs]
        rows.append({"name": arm, "seeds": [r["seed"] for r in rs], "final_mean": statistics.fmean(finals),
                     "final_half_range": (max(finals) - min(finals)) / 2, "finals": finals,
                     "steps_to_target": _mean_or_none([None if h is None else h[0] for h in hits])})
    return rows


def validation_row(arm: str, link: str, curve: Sequence[Sequence[float]], measured_elapsed: Sequence[float],
                   target: float | None, step_ms: float, eval_s: float, warmup_steps: int = 0,
                   warmup_ms: float | None = None, metric: Metric = ACCURACY) -> dict:
    """Composed against measured seconds to ``target`` for a run timed end to end on ``link``:
    ``measured_elapsed[i]`` is the run's own clock at its ``i``-th evaluation (fit start to the
    end of that evaluation). ``target=None`` compares at the run's last evaluation instead (a
    shortened validation run that stops before the target)."""
    if target is None:
        hit = (int(curve[-1][0]), len(curve)) if curve else None
    else:
        hit = steps_to(curve, target, metric)
    composed = None if hit is None else train_seconds(hit[0], step_ms, warmup_steps, warmup_ms) + hit[1] * eval_s
    measured = None if hit is None else measured_elapsed[hit[1] - 1]
    return {"arm": arm, "link": link, "at_step": None if hit is None else hit[0], "composed_s": composed,
            "measured_s": measured,
            "rel_error": None if composed is None or not measured else (composed - measured) / measured}


def table(result: dict) -> str:
    """The Markdown tables of docs/time-to-accuracy.md: one row per arm (finished runs only) with its
    step time, time to the headline target and speedups against ``sync`` and the fastest DDP arm per
    link (``(tie)`` where the ratio's range over seeds and timing rounds includes 1.0,
    :func:`speedup_ranges`); then the pipe arms' speedup over the fastest DDP arm for every target
    of the sweep. ``±`` is half the range of the seeds' final accuracies."""
    target, metric = result["target_accuracy"], metric_of(result)
    links = list(result["links"])
    head = ["arm", "seeds", "final test acc %", f"steps to {target:.2f} %"] if metric is ACCURACY else \
        ["arm", "seeds", f"final {metric.key.replace('_', ' ')}", f"steps to {target:.4f}"]
    for link in links:
        head += [f"ms/step {link}", f"time to target {link}", f"vs sync / best DDP {link}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    finished = [r for r in result["arms"] if r.get("complete", True)]
    digits = 4 if metric.lower_is_better else 2
    for row in arm_summary(finished, target, metric):
        arm = row["name"]
        spread = f" ± {row['final_half_range']:.{digits}f}" if len(row["seeds"]) > 1 else ""
        steps = row["steps_to_target"]
        cells = [arm, str(len(row["seeds"])), f"{row['final_mean']:.{digits}f}{spread}",
                 "not reached" if steps is None else f"{steps:.0f}"]
        for link in links:
            block = result["links"][link]
            ms, t = block["step_ms"].get(arm), block["time_to_target_s"].get(arm)
            ups = [(block.get("speedup", {}).get(b, {}).get(arm),
                    block.get("speedup_range", {}).get(b, {}).get(arm, {}).get("verdict")) for b in ("sync", "best ddp")]
            cells += ["–" if ms is None else f"{ms:.0f}", "–" if t is None else f"{t / 60:.1f} min",
                      " / ".join("–" if u is None else f"{u:.2f}×" + (" (tie)" if v == "tie" else "") for u, v in ups)]
        lines.append("| " + " | ".join(cells) + " |")
    sweep = sweep_table(result)
    return "\n".join(lines) + "\n" + ("\n" + sweep if sweep else "")


def sweep_table(result: dict) -> str:
    """Per link and pipe arm: the speedup over the fastest DDP arm at each target of the sweep, and
    the share of compute alone's gain over that DDP arm the arm captures per step."""
    names = [n for n in result.get("targets", {}) if n.startswith("slack") or n == f"{SWEEP_FIXED:g}"]
    if not names:
        return ""
    head = ["link", "arm", *[f"vs best DDP at {n} ({result['targets'][n]:.2f} %)" for n in names],
            "per step: share of compute alone's gain"]
    rows = []
    for link, block in result["links"].items():
        cap = block.get("ceiling") or {}
        for arm in block.get("time_to_target_s", {}):
            if not pipelined(arm):
                continue
            cells = [link, arm]
            for name in names:
                t = block["targets"][name]
                up = t["speedup"].get("best ddp", {}).get(arm)
                cells.append("–" if up is None else f"{up:.2f}× ({t['best_ddp']})")
            got = (cap.get("captured") or {}).get(arm)
            cells.append("–" if got is None else f"{100 * got:.0f} % (ceiling {cap['ceiling_speedup']:.2f}×)")
            rows.append("| " + " | ".join(cells) + " |")
    if not rows:
        return ""
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *rows]) + "\n"


def accounting_table(result: dict) -> str:
    """Markdown: per link and pipe arm, the speedup over the fastest DDP arm at the headline target
    in each accounting of the warm-ups (the headline first), and the rates each charged."""
    names = [result.get("warmup_accounting", {}).get("headline", HEADLINE_ACCOUNTING),
             *result.get("warmup_accounting", {}).get("also", [])]
    rows = []
    for link, block in result["links"].items():
        views = [block if i == 0 else block.get("accountings", {}).get(name) for i, name in enumerate(names)]
        for arm in block.get("time_to_target_s", {}):
            if not pipelined(arm):
                continue
            cells = [link, arm]
            for view in views:
                t = (view or {}).get("targets", {}).get("target", {})
                up = t.get("speedup", {}).get("best ddp", {}).get(arm)
                cells.append("–" if up is None else f"{up:.2f}× ({t['best_ddp']})")
            rows.append("| " + " | ".join(cells) + " |")
    if not rows:
        return ""
    head = ["link", "arm", *[f"vs best DDP, warm-ups at {n.replace('_', ' ')}" + (" (headline)" if i == 0 else "")
                             for i, n in enumerate(names)]]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *rows]) + "\n"


SPEED_GOALS = {"100mbit": 1.15, "50mbit": 1.35}
"""The study's speed goal per link: the best pipe arm reaches every target of the sweep this many times
sooner than the best DDP arm, or, where compute alone is not that much faster than the best DDP arm
(physics caps the speedup), captures :data:`CAPTURE_GOAL` of the per-step gain compute alone allows."""
LOSS_SPEED_GOALS = {"50mbit": 1.15}
"""A lower-is-better study's speed goal (the GPT recipe's: the best pipe arm 1.15x sooner at 50 Mbit/s)."""
CAPTURE_GOAL = 0.8
COMPRESSED_PIPE_ARMS = ("pipe+lookahead-int8", "pipe+lookahead-fp16")
"""Arms that must end within :data:`SAME_ACCURACY_PP` of ``sync`` (mean over seeds)."""
VALIDATION_GOAL = 0.05
"""Composed against measured time, for ``sync`` and the headline arm on every validated link."""
STEADY_WINDOW = 100
"""A validation's bracket times the steady state when its window starts at step >= this and spans
>= this many steps. Where an arm has such rows, the validation goal judges those: 40-step windows
right after start-up missed a long run's step by up to 6 % either way on this host (docs/time-to-accuracy.md)."""


def steady_window(row: dict) -> bool:
    """Whether a validation row was composed against a bracket that timed the steady state."""
    window = row.get("window") or {}
    return (window.get("first") or 0) >= STEADY_WINDOW and (window.get("steps") or 0) >= STEADY_WINDOW


def _final_means(arms: Sequence[dict], metric: Metric = ACCURACY) -> dict[str, float]:
    by_arm: dict[str, list[float]] = {}
    for r in arms:
        if r.get("complete", True) and r.get(f"final_{metric.key}") is not None:
            by_arm.setdefault(r["name"], []).append(r[f"final_{metric.key}"])
    return {arm: statistics.fmean(v) for arm, v in by_arm.items()}


def _speed_goal(link: str, block: dict, threshold: float, eligible: list[str], slacks: list[str]) -> dict:
    row = {"goal": f"speed {link}", "link": link, "threshold": threshold, "eligible_arms": eligible}
    cap = block.get("ceiling")
    if cap and cap.get("ddp_arms_never_at_target"):
        row["ddp_arms_never_at_target"] = cap["ddp_arms_never_at_target"]
    if not cap or cap.get("ceiling_speedup") is None:
        return row | {"met": None, "why": "no compute-alone or DDP step time on this link"}
    row["ceiling_speedup"] = cap["ceiling_speedup"]
    if cap["best_ddp"] not in block.get("time_to_target_s", {}):
        row["provisional"] = (f"{cap['best_ddp']}, the fastest DDP arm per step, has no curve yet: "
                              "its time to accuracy is not known")
    if cap["ceiling_speedup"] < threshold:
        captured = {arm: cap["captured"].get(arm) for arm in eligible if cap["captured"].get(arm) is not None}
        best = max(captured, key=captured.get) if captured else None
        return row | {"applies": "capture", "capture_threshold": CAPTURE_GOAL, "arm": best,
                      "value": captured.get(best), "met": None if best is None else captured[best] >= CAPTURE_GOAL,
                      "why": f"compute alone is only {cap['ceiling_speedup']:.2f}x faster per step than "
                             f"{cap['best_ddp']}, below {threshold:.2f}x"}
    per_slack = {}
    for name in slacks:
        ups = {arm: block["targets"][name]["speedup"].get("best ddp", {}).get(arm) for arm in eligible}
        ups = {arm: u for arm, u in ups.items() if u is not None}
        per_slack[name] = None if not ups else {"arm": max(ups, key=ups.get), "speedup": max(ups.values()),
                                                "best_ddp": block["targets"][name]["best_ddp"]}
    worst = None if any(v is None for v in per_slack.values()) or not per_slack else \
        min(v["speedup"] for v in per_slack.values())
    return row | {"applies": "speedup", "per_slack": per_slack, "value": worst,
                  "met": None if worst is None else worst >= threshold,
                  "why": "" if worst is not None else "some target of the sweep has no priced pipe or DDP arm"}


def _goal_arm(goal: dict, metric: Metric = ACCURACY) -> str | None:
    """The pipe arm a speed goal rests on: the best capturer, or the best arm at the headline slack."""
    if goal.get("applies") == "capture":
        return goal.get("arm")
    at = (goal.get("per_slack") or {}).get(metric.headline_slack)
    return at["arm"] if at else None


def goals(result: dict, speed_goals: dict[str, float] | None = None) -> list[dict]:
    """The study's goals, each ``met`` True/False, or None where the result cannot tell (``why``).

    Speed: on each link of ``speed_goals`` (default :data:`SPEED_GOALS`), among pipe arms that end
    within :data:`SAME_ACCURACY_PP` of ``sync``, the best one's speedup over the best DDP arm at
    every slack target, worst case over the sweep; or the per-step share of compute alone's gain
    where the ceiling is below the threshold. Accuracy: each compressed pipe arm's mean final
    accuracy against ``sync``'s. Validation: each row of ``sync``, the headline arm (the speed goal's
    arm on the first link) and any other validated arm within :data:`VALIDATION_GOAL`; only an arm's
    steady-window rows (:func:`steady_window`) where it has any, the others under ``left_out``."""
    metric = metric_of(result)
    if speed_goals is None:
        speed_goals = LOSS_SPEED_GOALS if metric.lower_is_better else SPEED_GOALS
    means = _final_means(result.get("arms", []), metric)
    sync = means.get("sync")
    eligible = [arm for arm in means if pipelined(arm) and sync is not None
                and metric.is_same(means[arm], sync)]
    slacks = [n for n in result.get("targets", {}) if n.startswith("slack")]
    out = []
    for link, threshold in speed_goals.items():
        block = result.get("links", {}).get(link)
        out.append({"goal": f"speed {link}", "link": link, "threshold": threshold, "met": None,
                    "why": "link not timed"} if block is None else _speed_goal(link, block, threshold, eligible, slacks))
    # a lower-is-better study also holds its default pipe arm (the recipe's rule) to sync's value
    for arm in (("pipe+lookahead",) if metric.lower_is_better else ()) + COMPRESSED_PIPE_ARMS:
        diff = None if sync is None or arm not in means else metric.gap(means[arm], sync)
        row = {"goal": f"{'loss' if metric.lower_is_better else 'accuracy'} {arm}", "arm": arm, "value": diff,
               "met": None if diff is None else metric.is_same(means[arm], sync),
               "why": "" if diff is not None else "no finished run of it and sync"}
        out.append(row | ({"threshold_rel": metric.same} if metric.lower_is_better else {"threshold_pp": metric.same}))
    headline = next((_goal_arm(g, metric) for g in out if g["goal"].startswith("speed") and _goal_arm(g, metric)),
                    None)
    validated = sorted({v["arm"] for v in result.get("validation", []) if v.get("rel_error") is not None}
                       - {"sync", headline})  # e.g. the best DDP arm, the ratios' divisor
    for arm in ("sync", headline, *validated):
        rows = [v for v in result.get("validation", []) if arm is not None and v["arm"] == arm
                and v.get("rel_error") is not None]
        steady = [v for v in rows if steady_window(v)]
        judged, left_out = (steady, [v for v in rows if not steady_window(v)]) if steady else (rows, [])
        errors = [v["rel_error"] for v in judged]
        out.append({"goal": f"validation {arm or 'headline arm'}", "arm": arm, "threshold": VALIDATION_GOAL,
                    "value": max(errors, key=abs) if errors else None,
                    "met": None if not errors else all(abs(e) <= VALIDATION_GOAL for e in errors),
                    "judged": [v["record"] for v in judged if v.get("record")],
                    "left_out": {v["record"]: v["rel_error"] for v in left_out if v.get("record")},
                    "why": "" if errors else "no validation record of it on a timed link"})
    return out


def goals_table(rows: Sequence[dict]) -> str:
    """Markdown: each goal, the value that decides it, and met / missed / not measured."""
    lines = ["| goal | value | needed | result |", "|---|---|---|---|"]
    for g in rows:
        verdict = {True: "met", False: "**missed**", None: "not measured"}[g["met"]]
        if g["goal"].startswith("speed"):
            if g.get("applies") == "capture":
                value = "–" if g.get("value") is None else f"{100 * g['value']:.0f} % of compute alone's gain ({g['arm']})"
                needed = (f"≥ {100 * g['capture_threshold']:.0f} % (ceiling {g['ceiling_speedup']:.2f}× "
                          f"< {g['threshold']:.2f}×)")
            else:
                value = "–" if g.get("value") is None else f"{g['value']:.2f}× (worst slack)"
                needed = f"≥ {g['threshold']:.2f}× vs best DDP at every slack"
        elif g["goal"].startswith("accuracy"):
            value = "–" if g["value"] is None else f"{g['value']:+.2f} pp vs sync"
            needed = f"≥ {g['threshold_pp']:+.1f} pp"
        elif g["goal"].startswith("loss"):
            value = "–" if g["value"] is None else f"{100 * g['value']:+.2f} % vs sync"
            needed = f"≤ {100 * g['threshold_rel']:+.1f} %"
        else:
            value = "–" if g["value"] is None else f"{100 * g['value']:+.1f} %"
            needed = f"within ±{100 * g['threshold']:.0f} %"
            if g.get("left_out"):
                value += (f" ({len(g['judged'])} steady-window run(s); earlier short-window runs left out: "
                          + ", ".join(f"{100 * e:+.1f} %" for e in g["left_out"].values()) + ")")
        why = f" ({g['why']})" if g.get("why") and g["met"] is None else ""
        why += f" (provisional: {g['provisional']})" if g.get("provisional") else ""
        if g.get("ddp_arms_never_at_target"):
            why += f" ({', '.join(g['ddp_arms_never_at_target'])} never reaches the target: left out of the ceiling)"
        lines.append(f"| {g['goal']} | {value} | {needed} | {verdict}{why} |")
    return "\n".join(lines) + "\n"
