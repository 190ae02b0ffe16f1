"""Reports on finished runs: ``python -m pipesgd_lab.report timeline RUN_DIR`` (a Gantt chart of a
few traced steps) and ``python -m pipesgd_lab.report sweep MULTIRUN_DIR`` (a table and plots of every
job of a sweep). Plots need matplotlib (``pip install pipesgd[plot]``); the tables do not."""

from .errors import ReportError
from .sweep import SweepReport, load_jobs, sweep_report
from .timeline import load_trace, overlap_stats, render_timeline

__all__ = ["ReportError", "SweepReport", "load_jobs", "load_trace", "overlap_stats", "render_timeline",
           "sweep_report"]
