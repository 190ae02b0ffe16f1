"""``python -m pipesgd_lab.bench.elastic_study [options] [Hydra overrides]``: what losing a node costs
in final accuracy (docs/reliability.md, "Elastic resume").

Per workload and seed, two runs with the same total samples:

* ``reference``: the whole run at the smaller world (``dist.nproc=2``);
* ``elastic``: the run starts on 3 ranks, rank 2 is SIGKILLed at ``kill_step`` (``PIPESGD_FAULT``),
  and the job resumes on 2 ranks from the newest checkpoint with ``trainer.elastic=true``.

Resumable: a finished run (summary.json) is skipped; an elastic run whose first part already
failed as planned resumes. Writes ``--json`` and prints a Markdown table. Accuracy runs share the
machine safely (the fixed-staleness update does not depend on timing).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from pipesgd.observability.runinfo import git_commit

from .runner import CellFailed, check_seeds_and_overrides, recorded, run_logged, save

log = logging.getLogger("pipesgd_lab.bench.elastic_study")
ROOT = Path()  # defaults are under the current directory (run from a clone's root to update its docs/)

WORKLOADS: dict[str, dict] = {
    # Both with staleness=lookahead: the plain rule on 3 ranks is itself unstable on MNIST at this
    # lr (70.85 % after one epoch against 96.60 % for sync), which would hide what the node loss costs.
    # 60000 / (3 x 64) = 312 steps per epoch on 3 ranks, 936 in all: killed at 470 (50 %), resumed
    # from the step-400 checkpoint, 88 batches into epoch 2.
    "mnist": {"overrides": ("+experiment=mnist_mlp", "staleness=lookahead", "trainer.epochs=3",
                            "data.batch_size=64", "trainer.checkpoint_every=100", "trainer.log_every=100"),
              "kill_step": 470},
    # ResNet-20: 50000 / (3 x 64) = 260 steps per epoch on 3 ranks, 520 in all: killed at 250 (48 %),
    # resumed from the step-200 checkpoint, 200 batches into epoch 1.
    "cifar10": {"overrides": ("+experiment=resnet_cifar", "staleness=lookahead", "trainer.epochs=2",
                              "data.batch_size=64", "trainer.checkpoint_every=100", "trainer.log_every=100"),
                "kill_step": 250},
}
"""Workload -> its overrides and the step after which rank 2 is killed. Spelled here only."""
OLD_WORLD, NEW_WORLD, KILLED_RANK = 3, 2, 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipesgd_lab.bench.elastic_study", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. data.root=PATH")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, from {', '.join(WORKLOADS)}")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--dir", type=Path, default=ROOT / "outputs" / "elastic_study", help="run directories")
    p.add_argument("--json", type=Path, default=ROOT / "results" / "elastic" / "elastic-accuracy.json", help="the result")
    p.add_argument("--timeout-s", type=float, default=4 * 3600.0, help="per run (default 4 h)")
    return p


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = build_parser()
    a = parser.parse_args(argv)
    a.workloads = [w for w in a.workloads.split(",") if w]
    bad = [w for w in a.workloads if w not in WORKLOADS]
    if bad or not a.workloads:
        parser.error(f"argument --workloads: {','.join(bad) or '(empty)'} is not one of {', '.join(WORKLOADS)}")
    check_seeds_and_overrides(parser, a)
    return a


def _command(a: argparse.Namespace, workload: str, seed: int, nproc: int, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pipesgd.train", *WORKLOADS[workload]["overrides"], f"seed={seed}",
            f"dist.nproc={nproc}", "dist.threads_per_worker=1", *a.overrides, *extra, f"hydra.run.dir={run_dir}"]


def _reference(a: argparse.Namespace, workload: str, seed: int) -> Path:
    run_dir = (a.dir / f"{workload}-s{seed}-reference").resolve()
    if not (run_dir / "summary.json").exists():
        cmd = _command(a, workload, seed, NEW_WORLD, run_dir, "trainer.resume=never")
        log.info("$ %s", recorded(cmd))
        run_logged(cmd, run_dir.parent / f"{run_dir.name}.log", a.timeout_s)
    return run_dir


def _elastic(a: argparse.Namespace, workload: str, seed: int) -> Path:
    run_dir = (a.dir / f"{workload}-s{seed}-elastic").resolve()
    if (run_dir / "summary.json").exists():
        return run_dir
    kill = WORKLOADS[workload]["kill_step"]
    if not (run_dir / "checkpoints").is_dir():
        cmd = _command(a, workload, seed, OLD_WORLD, run_dir)
        log.info("$ PIPESGD_FAULT=kill:%d:%d %s", KILLED_RANK, kill, recorded(cmd))
        try:
            run_logged(cmd, run_dir.parent / f"{run_dir.name}-part1.log", a.timeout_s,
                       env={"PIPESGD_FAULT": f"kill:{KILLED_RANK}:{kill}"})
        except CellFailed:
            pass  # the planned loss of a node
        else:
            raise CellFailed(f"{run_dir}: the run on {OLD_WORLD} ranks finished although rank {KILLED_RANK} "
                             f"was to be killed at step {kill}")
    cmd = _command(a, workload, seed, NEW_WORLD, run_dir, "trainer.elastic=true", "trainer.resume=auto")
    log.info("$ %s", recorded(cmd))
    run_logged(cmd, run_dir.parent / f"{run_dir.name}-part2.log", a.timeout_s)
    return run_dir


def _spread(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs),
            "stdev": statistics.stdev(xs) if len(xs) > 1 else None}


def result(a: argparse.Namespace) -> dict:
    rows = []
    for workload in a.workloads:
        runs = {"reference": [], "elastic": []}
        resharded = []
        for seed in a.seeds:
            for arm in runs:
                path = a.dir / f"{workload}-s{seed}-{arm}" / "summary.json"
                if path.exists():
                    s = json.loads(path.read_text())
                    runs[arm].append({"seed": seed, "test_accuracy": 100 * s["test_accuracy"]})
                    if arm == "elastic":
                        resharded.append(s["resharded"])
        done = {arm: [r["test_accuracy"] for r in v] for arm, v in runs.items()}
        paired = [e["test_accuracy"] - r["test_accuracy"] for e in runs["elastic"] for r in runs["reference"]
                  if e["seed"] == r["seed"]]
        rows.append({"workload": workload, "overrides": list(WORKLOADS[workload]["overrides"]),
                     "kill_step": WORKLOADS[workload]["kill_step"], "runs": runs, "resharded": resharded,
                     "reference": _spread(done["reference"]) if done["reference"] else None,
                     "elastic": _spread(done["elastic"]) if done["elastic"] else None,
                     "paired_difference_pp": _spread(paired) if paired else None})
    return {"old_world": OLD_WORLD, "new_world": NEW_WORLD, "killed_rank": KILLED_RANK, "seeds": a.seeds,
            "overrides": list(a.overrides), "workloads": rows, "commit": git_commit(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def table(res: dict) -> str:
    lines = ["| workload | seeds | uninterrupted at 2 ranks, % | lose 1 of 3 ranks halfway, % | "
             "paired difference, pp | reference seed range, pp |", "|---|---|---|---|---|---|"]
    for row in res["workloads"]:
        ref, ela, diff = row["reference"], row["elastic"], row["paired_difference_pp"]
        if not (ref and ela and diff):
            continue
        lines.append(f"| {row['workload']} | {len(row['runs']['elastic'])} | {ref['mean']:.2f} "
                     f"({ref['min']:.2f}–{ref['max']:.2f}) | {ela['mean']:.2f} ({ela['min']:.2f}–{ela['max']:.2f}) "
                     f"| {diff['mean']:+.2f} ({diff['min']:+.2f} to {diff['max']:+.2f}) | {ref['max'] - ref['min']:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    ok = True
    for workload in a.workloads:
        for seed in a.seeds:
            for run in (_reference, _elastic):
                try:
                    run(a, workload, seed)
                except CellFailed as e:
                    log.error("%s", e)
                    ok = False
    res = result(a)
    save(a.json, res)
    print(table(res))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
