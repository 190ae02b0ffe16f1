"""``python -m pipesgd_lab.bench.outer_sweep DIR [DIR ...] [--json OUT] [--table OUT]``: the outer
optimizer's sweep (docs/period-h.md, "Outer settings that follow H and M") as one record.

Reads every ``summary.json`` below the given Hydra multirun directories, keys each run by its
schedule (H, the replicas M, the rule, fragments, delay, landing mix) and its outer step (lr,
momentum, Nesterov), and per schedule names the best setting the sweep found, the setting
:func:`pipesgd.outer.settings` picks by default for that H and M, and the default's final loss over
the best one's (``None`` where the default's setting was not run). Runs at ``trainer.sync_every=1``
(synchronous training, no outer step) are the reference each schedule is priced against.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from pipesgd.outer import settings


def _run(summary: dict) -> dict:
    cfg = summary["config"]
    # the step that ran (outer_optimizer=auto leaves the config's values null and records what it chose)
    outer, trainer = summary.get("outer_step") or cfg.get("outer_optimizer", {}), cfg["trainer"]
    h = int(summary.get("sync_every", 1))
    k = int(summary.get("ranks_per_replica") or cfg["dist"].get("ranks_per_replica") or 1)
    return {"sync_every": h, "replicas": summary["world_size"] // k, "ranks_per_replica": k,
            "mode": summary["mode"], "rule": summary.get("outer_rule", "none"),
            "compressor": summary["compressor"], "fragments": int(summary.get("fragments", 1)),
            "sync_delay": int(summary.get("sync_delay", 0)),
            "landing_alpha": summary.get("landing_alpha", trainer.get("landing_alpha")),  # auto: the share that ran
            "lr": outer.get("lr") if h > 1 else None, "momentum": outer.get("momentum") if h > 1 else None,
            "nesterov": bool(outer.get("nesterov")) if h > 1 else None,
            "seed": cfg.get("seed"), "steps": summary["steps"], "test_loss": summary["test_loss"],
            "git_commit": summary.get("git_commit"), "host": summary.get("host")}


def collect(dirs: list[Path]) -> list[dict]:
    """Every finished run below ``dirs`` (a run that died leaves no summary.json and is absent)."""
    runs = []
    for d in dirs:
        for path in sorted(d.rglob("summary.json")):
            run = _run(json.loads(path.read_text()))
            run["path"] = str(path)
            runs.append(run)
    return runs


_SCHEDULE = ("sync_every", "replicas", "ranks_per_replica", "mode", "rule", "compressor", "fragments", "sync_delay",
             "landing_alpha", "steps")
_OUTER = ("lr", "momentum", "nesterov")


def study(runs: list[dict]) -> dict:
    """Per schedule: each outer setting's mean final loss over its seeds, the best, the default and
    the default's excess over the best; sync's loss at the same M and steps where it was run, and
    each setting's loss over it on the seeds both ran (``vs_sync``, ``sync_seeds``)."""
    sync: dict[tuple, dict] = defaultdict(lambda: defaultdict(list))  # (M, steps) -> seed -> losses
    for r in runs:
        if r["sync_every"] == 1:
            sync[(r["replicas"], r["steps"])][r["seed"]].append(r["test_loss"])
    groups: dict[tuple, dict[tuple, list[tuple]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        if r["sync_every"] > 1:
            groups[tuple(r[k] for k in _SCHEDULE)][tuple(r[k] for k in _OUTER)].append((r["seed"], r["test_loss"]))
    rows = []
    for key, by_setting in sorted(groups.items(), key=lambda kv: [str(v) for v in kv[0]]):
        sched = dict(zip(_SCHEDULE, key))
        means = {s: statistics.fmean(loss for _, loss in v) for s, v in by_setting.items()}
        best = min(means, key=means.get)
        pick = settings(sched["sync_every"], sched["replicas"])
        default = (pick.lr, pick.momentum, pick.nesterov)
        match = next((s for s in means if _same(s, default)), None)
        ref = sync.get((sched["replicas"], sched["steps"]), {})
        rows.append({**sched, "settings": [{**dict(zip(_OUTER, s)), "test_loss": means[s], "seeds": len(by_setting[s]),
                                            "seed_list": sorted({seed for seed, _ in by_setting[s]}, key=str),
                                            **_vs_sync(by_setting[s], ref)} for s in sorted(means, key=means.get)],
                     "best": dict(zip(_OUTER, best)), "best_loss": means[best], "default": dict(zip(_OUTER, default)),
                     "default_loss": means[match] if match else None,
                     "default_over_best": means[match] / means[best] - 1 if match else None,
                     "sync_loss": statistics.fmean(x for v in ref.values() for x in v) if ref else None})
    return {"kind": "outer-sweep", "runs": runs, "schedules": rows}


def _vs_sync(runs: list[tuple], sync: dict) -> dict:
    """A setting's final loss over sync's on the seeds both ran (paired: seeds spread more than the
    arms differ, so a mean over other seeds would mix the two), and which seeds those were."""
    paired = sorted({seed for seed, _ in runs if seed in sync}, key=str)
    if not paired:
        return {"vs_sync": None, "sync_seeds": []}
    arm = statistics.fmean(loss for seed, loss in runs if seed in sync)
    ref = statistics.fmean(statistics.fmean(sync[seed]) for seed in paired)
    return {"vs_sync": arm / ref - 1, "sync_seeds": paired}


def _same(a: tuple, b: tuple) -> bool:
    return all(abs(float(x) - float(y)) < 1e-9 for x, y in zip(a[:2], b[:2])) and bool(a[2]) == bool(b[2])


def table(record: dict) -> str:
    """Markdown: one row per schedule and outer setting, best first (steps: the run's length, the
    cosine ending at its last; M replicas of k ranks; "vs sync":
    against sync at the same M, whose ranks are M, on the seeds both ran, named where not all)."""
    lines = ["| steps | H | M × k | arm | outer lr | momentum | final loss | vs best | vs sync | |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in record["schedules"]:
        arm = f"{'blocking' if row['mode'] == 'sync' else 'in flight'} {row['compressor']}" + (
            f" {row['rule']}" if row["rule"] != "none" else "") + (f" F={row['fragments']}" if row["fragments"] > 1 else "") + (
            f" τ={row['sync_delay']}" if row["sync_delay"] else "") + (
            f" α={row['landing_alpha']}" if row["landing_alpha"] is not None else "")
        for s in row["settings"]:
            mark = "default" if _same((s["lr"], s["momentum"], s["nesterov"]),
                                      tuple(row["default"][k] for k in _OUTER)) else ""
            sync = "-" if s["vs_sync"] is None else f"{s['vs_sync']:+.2%}" + (
                "" if s["sync_seeds"] == s["seed_list"] else f" (seed {', '.join(map(str, s['sync_seeds']))})")
            lines.append(f"| {row['steps']} | {row['sync_every']} | {row['replicas']} × {row['ranks_per_replica']} | {arm} | {s['lr']} | "
                         f"{s['momentum']}{' N' if s['nesterov'] else ''} | {s['test_loss']:.4f} "
                         f"({s['seeds']} seed{'s' if s['seeds'] > 1 else ''}) | "
                         f"{s['test_loss'] / row['best_loss'] - 1:+.2%} | {sync} | {mark} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipesgd_lab.bench.outer_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", type=Path, help="Hydra multirun directories (or any parents of summary.json)")
    p.add_argument("--json", type=Path, help="write the record here")
    p.add_argument("--table", type=Path, help="write the Markdown table here")
    a = p.parse_args(argv)
    missing = [str(d) for d in a.dirs if not d.is_dir()]
    if missing:
        p.error(f"not a directory: {', '.join(missing)}")
    record = study(collect(a.dirs))
    if not record["runs"]:
        p.error(f"no summary.json below {', '.join(map(str, a.dirs))}")
    text = table(record)
    for path, body in ((a.json, json.dumps(record, indent=1)), (a.table, text + "\n")):
        if path:
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(body)
            tmp.replace(path)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
