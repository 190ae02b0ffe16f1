"""What an exchange costs the cores, read from a run's ``trace.json`` (``trainer.trace=true``).

On a host whose cores all run compute, whatever else runs while the exchange is in flight comes out
of forward and backward. Per rank this splits the traced steps' forward + backward into those with
the backend on the wire under at least half of them (the ring's reduce-scatter and allgather, the
native allreduce: spans of category ``comm`` on the communication thread, the average excepted)
and those with nothing of the exchange under them; the gap between the two medians is what the
exchange takes from compute. Beside it, what the engine's own work costs: the communication
thread's encode, decode and average (CPU the engine spends beside compute), and the training
thread's pack and update (on the critical path, not beside it). Where the gap is larger than the
engine's CPU beside compute, the rest is the backend's (its I/O threads, the kernel's TCP and the
link's queue), which the engine cannot cut.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from .errors import ReportError
from .timeline import Span, Trace, clipped

WIRE = ("reduce-scatter", "allgather", "all_reduce")
"""The communication thread's spans that are the backend's send and receive."""
ENGINE_BESIDE = ("encode", "decode", "decode+add", "average")
"""The communication thread's spans that are the engine's own CPU work, run beside compute."""
ENGINE_INLINE = ("pack", "update")
"""The training thread's spans that are the engine's own work, on the step's critical path."""
UNDER = 0.5
"""A step counts as under the exchange when the wire covers at least this share of its forward + backward."""


def _overlap(a: Span, spans: Sequence[Span]) -> float:
    return sum(clipped(s, a.start_ms, a.end_ms) for s in spans)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def rank_cost(trace: Trace, rank: int, skip: int = 0) -> dict:
    """One rank's account over its traced steps from ``skip`` on: the medians of forward + backward
    with the wire under it (``under``) and with nothing of the exchange under it (``alone``), their
    gap, the engine's own work under those steps (the median over them of its communication-thread
    spans' overlap with their compute) and the rest of the gap (the backend's), and the engine's own
    milliseconds per step, beside compute and inline, by span name."""
    spans = [s for s in trace.spans if s.rank == rank]
    comm = [s for s in spans if s.tid != 0]
    wire = [s for s in comm if s.name in WIRE]
    own = [s for s in comm if s.name in ENGINE_BESIDE]
    steps: dict[int, list[Span]] = {}
    for s in spans:
        if s.tid == 0 and s.cat == "compute" and s.step is not None and s.step >= skip:
            steps.setdefault(s.step, []).append(s)
    under, alone, own_under = [], [], []
    for parts in steps.values():
        length = sum(p.end_ms - p.start_ms for p in parts)
        covered = sum(_overlap(p, wire) for p in parts)
        touched = sum(_overlap(p, comm) for p in parts)
        if covered >= UNDER * length:
            under.append(length)
            own_under.append(sum(_overlap(p, own) for p in parts))
        elif touched == 0.0:
            alone.append(length)
    first = min(steps, default=skip)
    start = min((p.start_ms for p in steps.get(first, [])), default=0.0)
    n = max(1, len(steps))

    def per_step(names: Sequence[str], pool: Sequence[Span]) -> dict[str, float]:
        return {name: sum(s.end_ms - s.start_ms for s in pool if s.name == name and s.end_ms > start) / n
                for name in names if any(s.name == name for s in pool)}

    beside = per_step(ENGINE_BESIDE, comm)
    inline = per_step(ENGINE_INLINE, [s for s in spans if s.tid == 0])
    med_under, med_alone = _median(under), _median(alone)
    gap = None if med_under is None or med_alone is None else med_under - med_alone
    beside_per_under = _median(own_under)  # the engine's spans that ran under those steps' compute
    return {"rank": rank, "steps": len(steps), "steps_under": len(under), "steps_alone": len(alone),
            "compute_under_ms": med_under, "compute_alone_ms": med_alone, "gap_ms": gap,
            "engine_beside_ms_per_step": beside, "engine_inline_ms_per_step": inline,
            "engine_beside_ms_per_step_under": beside_per_under,
            "backend_ms_per_step_under": None if gap is None or beside_per_under is None
            else gap - beside_per_under}


def core_cost(trace: Trace, skip: int | None = None) -> list[dict]:
    """:func:`rank_cost` for every rank in the trace; ``skip`` defaults to the synchronous warm-up
    and the pipeline's fill plus one step (the first steps run with cold caches)."""
    if skip is None:
        skip = int(trace.meta.get("warmup_sync_steps") or 0) + int(trace.meta.get("width") or 1)
    ranks = sorted({s.rank for s in trace.spans})
    out = [rank_cost(trace, r, skip) for r in ranks]
    if not any(r["steps_under"] for r in out):
        raise ReportError("no traced step ran with the exchange on the wire under it: nothing to compare "
                          "(trace more steps, or a run whose exchange overlaps compute)")
    return out


def table(rows: Sequence[dict]) -> str:
    """The account as a markdown table, a row per rank."""
    def f(v):
        return "–" if v is None else f"{v:.1f}"
    lines = ["| rank | steps under / alone | compute under ms | alone ms | gap ms | engine beside, per step under ms "
             "| backend, per step under ms | engine inline ms/step |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        inline = ", ".join(f"{k} {v:.1f}" for k, v in r["engine_inline_ms_per_step"].items()) or "–"
        lines.append(f"| {r['rank']} | {r['steps_under']} / {r['steps_alone']} | {f(r['compute_under_ms'])} | "
                     f"{f(r['compute_alone_ms'])} | {f(r['gap_ms'])} | {f(r['engine_beside_ms_per_step_under'])} | "
                     f"{f(r['backend_ms_per_step_under'])} | {inline} |")
    return "\n".join(lines) + "\n"
