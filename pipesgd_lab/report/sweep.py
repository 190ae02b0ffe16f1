"""The sweep report: every job's summary.json of a multirun as one table and two plots.

Outputs (into the multirun directory unless told otherwise):

- ``sweep.md`` and ``sweep.csv``: one row per job with mode, width, compressor, allreduce, p,
  test accuracy, median iteration / compute / exposed comm / update ms, the timing model's
  prediction and the speedup of the median iteration time over the sync job of the same
  model, data, p and global batch (the ``compressor=none`` one when the sweep has several);
- ``sweep_accuracy.png``: test accuracy against wall time (``summary["evals"]``), so modes are
  compared by time to accuracy, not by step;
- ``sweep_breakdown.png``: each job's median iteration split into compute, exposed comm, update
  and the rest (data loading, flatten, hand-off), with the predicted time marked.
"""

from __future__ import annotations

import csv
import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from .errors import ReportError
from .figure import new_figure

log = logging.getLogger(__name__)

COLUMNS = ("job", "mode", "width", "compressor", "allreduce", "p", "steps", "test_accuracy", "iter_ms",
           "compute_ms", "exposed_comm_ms", "update_ms", "predicted_iter_ms", "speedup_vs_sync",
           "wall_seconds")


@dataclass
class Job:
    name: str          # the job's directory relative to the sweep directory
    summary: dict

    def get(self, key: str):
        return self.summary.get(key)

    @property
    def group(self) -> tuple:
        """Jobs are comparable (for the speedup) when these agree."""
        cfg = self.summary.get("config", {})
        return (self.get("world_size"), cfg.get("model", {}).get("_target_"),
                cfg.get("data", {}).get("_target_"), self.get("global_batch"))

    @property
    def label(self) -> str:
        return f"{self.name}: {self.get('mode')} K={self.get('width')} {self.get('compressor')}"


def load_jobs(sweep_dir: str | Path) -> list[Job]:
    """Every ``summary.json`` below ``sweep_dir`` (any depth), ordered by job directory."""
    root = Path(sweep_dir)
    if not root.is_dir():
        raise ReportError(f"sweep directory {root} does not exist")
    jobs = []
    for path in sorted(root.rglob("summary.json"), key=lambda p: _natural(p.parent.relative_to(root))):
        try:
            summary = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ReportError(f"{path} is not valid JSON ({e})") from None
        name = str(path.parent.relative_to(root)) or "."
        jobs.append(Job(name, summary))
    if not jobs:
        raise ReportError(f"no summary.json under {root}: expected a Hydra multirun directory whose "
                          "jobs finished (e.g. multirun/DATE/TIME with 0/summary.json, 1/summary.json, ...)")
    return jobs


def _natural(rel: Path) -> tuple:
    """Sort 2 before 10 in job numbers."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in rel.parts)


def _baseline(job: Job, jobs: list[Job]) -> Job | None:
    syncs = [j for j in jobs if j.get("mode") == "sync" and j.group == job.group and j.get("median_iter_ms")]
    syncs.sort(key=lambda j: j.get("compressor") != "none")
    return syncs[0] if syncs else None


def rows(jobs: list[Job]) -> list[dict]:
    out = []
    for j in jobs:
        base = _baseline(j, jobs)
        it = j.get("median_iter_ms")
        out.append({
            "job": j.name, "mode": j.get("mode"), "width": j.get("width"), "compressor": j.get("compressor"),
            "allreduce": j.get("allreduce"), "p": j.get("world_size"), "steps": j.get("steps"),
            "test_accuracy": j.get("test_accuracy"), "iter_ms": it, "compute_ms": j.get("median_compute_ms"),
            "exposed_comm_ms": j.get("median_exposed_comm_ms"), "update_ms": j.get("median_update_ms"),
            "predicted_iter_ms": j.get("predicted_iter_ms"),
            "speedup_vs_sync": base.get("median_iter_ms") / it if base is not None and it else None,
            "wall_seconds": j.get("wall_seconds"),
        })
    return out


def _fmt(key: str, value) -> str:
    if value is None:
        return "n/a"
    if key == "test_accuracy":
        return f"{100 * value:.2f}%"
    if key == "speedup_vs_sync":
        return f"{value:.2f}x"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def to_markdown(table: list[dict]) -> str:
    head = "| " + " | ".join(COLUMNS) + " |\n| " + " | ".join("---" for _ in COLUMNS) + " |\n"
    body = "".join("| " + " | ".join(_fmt(c, r[c]) for c in COLUMNS) + " |\n" for r in table)
    notes = []
    if any(r["speedup_vs_sync"] is None for r in table):
        notes.append("n/a speedup: no finished sync job with the same p, model, data and global batch.")
    notes.append("Times are medians over each job's steps, in ms; accuracy is the final test accuracy.")
    return head + body + "\n" + "\n".join(notes) + "\n"


def to_csv(table: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(table)
    return buf.getvalue()


def plot_accuracy(jobs: list[Job], path: Path) -> None:
    fig = new_figure(7, 4.5)
    ax = fig.subplots()
    for j in jobs:
        evals = j.get("evals") or []
        if evals:
            ax.plot([e["elapsed_s"] for e in evals], [100 * e["test_accuracy"] for e in evals],
                    marker="o", markersize=3, label=j.label)
    ax.set_xlabel("wall time since training started (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Time to accuracy", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(path)


def plot_breakdown(jobs: list[Job], path: Path) -> None:
    parts = [("compute", "median_compute_ms", "#4C72B0"), ("exposed comm", "median_exposed_comm_ms", "#C44E52"),
             ("update", "median_update_ms", "#55A868")]
    fig = new_figure(8, 1.2 + 0.45 * len(jobs))
    ax = fig.subplots()
    ys = range(len(jobs))
    left = [0.0] * len(jobs)
    for label, key, color in parts:
        widths = [j.get(key) or 0.0 for j in jobs]
        ax.barh(ys, widths, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, widths)]
    rest = [max(0.0, (j.get("median_iter_ms") or 0.0) - done) for j, done in zip(jobs, left)]
    ax.barh(ys, rest, left=left, color="#CCCCCC", label="other (data, flatten, hand-off)")
    predicted = [(y, j.get("predicted_iter_ms")) for y, j in zip(ys, jobs) if j.get("predicted_iter_ms")]
    if predicted:
        ax.scatter([p for _, p in predicted], [y for y, _ in predicted], marker="|", s=300, color="black",
                   label="predicted iteration", zorder=3)
    ax.set_yticks(list(ys))
    ax.set_yticklabels([j.label for j in jobs], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("median iteration time (ms)")
    ax.set_title("Where an iteration's time goes", fontsize=10)
    fig.legend(fontsize=7, loc="outside lower center", ncol=5, frameon=False)
    fig.savefig(path)


@dataclass
class SweepReport:
    table: list[dict]
    markdown: str
    files: list[Path]


def sweep_report(sweep_dir: str | Path, out_dir: str | Path | None = None, plots: bool = True) -> SweepReport:
    """Gather ``sweep_dir``'s jobs and write sweep.md, sweep.csv and (``plots``) the two PNGs."""
    jobs = load_jobs(sweep_dir)
    out = Path(out_dir) if out_dir is not None else Path(sweep_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = rows(jobs)
    markdown = to_markdown(table)
    files = [out / "sweep.md", out / "sweep.csv"]
    files[0].write_text(f"# Sweep {Path(sweep_dir).resolve()}\n\n{markdown}")
    files[1].write_text(to_csv(table))
    if plots:
        files += [out / "sweep_accuracy.png", out / "sweep_breakdown.png"]
        plot_accuracy(jobs, files[2])
        plot_breakdown(jobs, files[3])
    log.info("sweep report of %d jobs: %s", len(jobs), ", ".join(str(f) for f in files))
    return SweepReport(table, markdown, files)
