"""The overlap timeline: a Gantt chart of a few traced steps, one lane per rank and thread.

Input is the ``trace.json`` a run writes with ``trainer.trace=true`` (pipesgd.observability.trace). The chart
shows the training thread's forward / backward / pack / wait / update next to the communication
thread's encode / exchange / decode spans, so the reduction of step t running under the
forward/backward of step t+1 (width 2) is visible, and so is every millisecond the training
thread waited for it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from .errors import ReportError
from .figure import new_figure

log = logging.getLogger(__name__)

COLORS = {
    "compute": "#4C72B0", "pack": "#937860", "wait": "#C44E52", "update": "#55A868",
    "comm": "#DD8452", "compress": "#8172B3", "eval": "#AAAAAA",
}
COMM_CATEGORIES = ("comm", "compress")


@dataclass(frozen=True)
class Span:
    rank: int
    tid: int
    name: str
    cat: str
    start_ms: float
    end_ms: float
    step: int | None


@dataclass
class Trace:
    spans: list[Span]
    threads: dict[tuple[int, int], str]
    meta: dict


def load_trace(path: str | Path) -> Trace:
    """Read a run dir's ``trace.json`` (or the file itself) into spans with times in ms."""
    path = Path(path)
    file = path / "trace.json" if path.is_dir() else path
    if not file.is_file():
        raise ReportError(f"no trace at {file}: run the training with trainer.trace=true "
                          "(it writes trace.json into the run directory)")
    try:
        data = json.loads(file.read_text())
        events = data["traceEvents"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ReportError(f"{file} is not a trace-event JSON file ({e})") from None
    spans, threads = [], {}
    for e in events:
        if e.get("ph") == "X":
            spans.append(Span(e["pid"], e["tid"], e["name"], e.get("cat", ""), e["ts"] / 1e3,
                              (e["ts"] + e["dur"]) / 1e3, e.get("args", {}).get("step")))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    if not spans:
        raise ReportError(f"{file} holds no spans (was the run shorter than one step?)")
    return Trace(spans, threads, data.get("otherData", {}))


def pick_steps(trace: Trace, count: int, first: int | None = None) -> list[int]:
    """``count`` consecutive traced steps starting at ``first``; by default from the middle of
    the traced steps that come after the synchronous warm-up and the pipeline's fill."""
    steps = sorted({s.step for s in trace.spans if s.name == "forward" and s.step is not None})
    if not steps:
        raise ReportError("the trace has no forward spans with a step number")
    if first is None:
        fill = int(trace.meta.get("warmup_sync_steps") or 0) + int(trace.meta.get("width") or 1) - 1
        steady = [s for s in steps if s >= fill] or steps
        first = steady[max(0, len(steady) // 2 - count // 2)]
    elif first not in steps:
        raise ReportError(f"step {first} is not in the trace; traced steps are {steps[0]}..{steps[-1]}")
    chosen = [s for s in steps if first <= s < first + count]
    return chosen


def window(trace: Trace, steps: list[int]) -> tuple[float, float]:
    """From the first forward of ``steps[0]`` on any rank to the last span of ``steps[-1]``."""
    starts = [s.start_ms for s in trace.spans if s.step == steps[0] and s.name == "forward"]
    ends = [s.end_ms for s in trace.spans if s.step == steps[-1] and s.tid == 0]
    return min(starts), max(ends)


def overlap_stats(trace: Trace, t0: float, t1: float) -> dict[str, float]:
    """Over ``[t0, t1]`` (ms), summed over ranks: how long the communication threads were busy,
    how long the training threads waited for them, and the hidden fraction 1 - waited / busy."""
    busy = sum(clipped(s, t0, t1) for s in trace.spans if s.tid != 0 and s.cat in COMM_CATEGORIES)
    waited = sum(clipped(s, t0, t1) for s in trace.spans if s.tid == 0 and s.cat == "wait")
    hidden = max(0.0, min(1.0, 1.0 - waited / busy)) if busy > 0 else 0.0
    return {"comm_busy_ms": busy, "waited_ms": waited, "hidden_fraction": hidden}


def clipped(s: Span, t0: float, t1: float) -> float:
    """How much of ``s`` lies inside ``[t0, t1]`` (ms)."""
    return max(0.0, min(s.end_ms, t1) - max(s.start_ms, t0))


def render_timeline(run_dir: str | Path, out: str | Path | None = None, steps: int = 4,
                    first: int | None = None) -> Path:
    """Draw ``steps`` traced steps of ``run_dir`` as a Gantt chart PNG; returns its path
    (default ``run_dir/timeline.png``)."""
    if steps < 1:
        raise ReportError(f"--steps must be >= 1, got {steps}")
    trace = load_trace(run_dir)
    chosen = pick_steps(trace, steps, first)
    t0, t1 = window(trace, chosen)
    lanes = sorted({(s.rank, s.tid) for s in trace.spans})
    stats = overlap_stats(trace, t0, t1)

    fig = new_figure(12, 1.8 + 0.45 * len(lanes))
    ax = fig.subplots()
    height = 0.8
    shown: set[str] = set()
    for y, lane in enumerate(lanes):
        by_cat: dict[str, list[tuple[float, float]]] = {}
        for s in trace.spans:
            if (s.rank, s.tid) == lane and s.end_ms > t0 and s.start_ms < t1:
                a, b = max(s.start_ms, t0), min(s.end_ms, t1)
                by_cat.setdefault(s.cat, []).append((a - t0, b - a))
        shown.update(by_cat)
        for cat, bars in by_cat.items():
            ax.broken_barh(bars, (y - height / 2, height), facecolors=COLORS.get(cat, "#333333"),
                           edgecolor="white", linewidth=0.3)
    for s in trace.spans:  # step boundaries, from rank 0's training thread
        if s.name == "forward" and s.rank == lanes[0][0] and s.tid == 0 and s.step in chosen:
            ax.axvline(s.start_ms - t0, color="black", linestyle=":", linewidth=0.8)
            ax.text(s.start_ms - t0, 1.0, f" step {s.step}", fontsize=8, va="bottom",
                    transform=ax.get_xaxis_transform())
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"rank {r} · {_thread_label(trace.threads.get((r, t), str(t)))}" for r, t in lanes])
    ax.invert_yaxis()
    ax.set_ylim(len(lanes) - 0.3, -0.7)
    ax.set_xlim(0, t1 - t0)
    ax.set_xlabel("time since the first step shown (ms)")
    present = [c for c in COLORS if c in shown]
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(color=COLORS[c], label=c) for c in present], ncol=len(present),
               loc="outside lower center", frameon=False, fontsize=8)
    m = trace.meta
    what = (f"{m.get('mode', '?')} (width {m.get('width', '?')}), compressor {m.get('compressor', '?')}, "
            f"{m.get('allreduce', '?')} allreduce, {len({r for r, _ in lanes})} ranks")
    if stats["comm_busy_ms"] > 0:
        verdict = (f"communication hidden behind compute: {100 * stats['hidden_fraction']:.0f}% "
                   f"(comm threads busy {stats['comm_busy_ms']:.1f} ms, training threads waited "
                   f"{stats['waited_ms']:.1f} ms, summed over ranks)")
    else:
        verdict = "no communication-thread spans here (one process, or DDP, which communicates inside backward)"
    ax.set_title(f"{what}: steps {chosen[0]}-{chosen[-1]}\n{verdict}", fontsize=9, pad=16)
    run_dir = Path(run_dir)
    path = Path(out) if out is not None else (run_dir if run_dir.is_dir() else run_dir.parent) / "timeline.png"
    fig.savefig(path)
    log.info("timeline of steps %d-%d written to %s", chosen[0], chosen[-1], path)
    return path


def _thread_label(name: str) -> str:
    return "comm" if name.startswith("pipesgd-comm") else name
