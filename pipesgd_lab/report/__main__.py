"""``python -m pipesgd_lab.report timeline RUN_DIR`` and ``python -m pipesgd_lab.report sweep MULTIRUN_DIR``.

timeline: renders RUN_DIR/trace.json (from ``trainer.trace=true``) as RUN_DIR/timeline.png.
sweep: gathers every job's summary.json below MULTIRUN_DIR into sweep.md, sweep.csv and two PNGs,
and prints the markdown table on stdout.
cores: what the exchange takes from compute on RUN_DIR's traced steps, per rank (pipesgd_lab.report.cores):
prints the table, writes RUN_DIR/cores.json.
scale-map: draws docs/scale-map.md's heatmaps (the timing model's arithmetic, no runs needed). Exit status 2 with one line naming the path when the
input is missing.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from pipesgd.observability.runinfo import write_json_atomic

from .cores import core_cost, table
from .errors import ReportError
from .scale_map import render_scale_maps
from .sweep import sweep_report
from .timeline import load_trace, render_timeline


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipesgd_lab.report", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("timeline", help="Gantt chart of a few traced steps of one run")
    t.add_argument("run_dir", help="a run directory with trace.json (or the trace file itself)")
    t.add_argument("--steps", type=int, default=4, help="how many consecutive steps to draw (default 4)")
    t.add_argument("--first", type=int, default=None, help="first step to draw (default: middle of the trace)")
    t.add_argument("--out", default=None, help="PNG path (default RUN_DIR/timeline.png)")
    c = sub.add_parser("cores", help="what the exchange takes from compute, per rank, from a run's trace")
    c.add_argument("run_dir", help="a run directory with trace.json (or the trace file itself)")
    c.add_argument("--skip", type=int, default=None,
                   help="steps to leave out at the start (default: the warm-up and the pipeline's fill, plus one)")
    c.add_argument("--out", default=None, help="JSON path (default RUN_DIR/cores.json)")
    s = sub.add_parser("sweep", help="table and plots of every job of a multirun")
    s.add_argument("sweep_dir", help="a Hydra multirun directory (summary.json files at any depth)")
    s.add_argument("--out", default=None, help="output directory (default: the sweep directory)")
    s.add_argument("--no-plots", action="store_true", help="only the markdown and CSV tables")
    m = sub.add_parser("scale-map", help="heatmaps of the best pipe arm over the best DDP arm (docs/scale-map.md)")
    m.add_argument("--out", default="docs/img", help="output directory (default docs/img)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        if args.command == "timeline":
            render_timeline(args.run_dir, args.out, args.steps, args.first)
        elif args.command == "cores":
            rows = core_cost(load_trace(args.run_dir), args.skip)
            run_dir = Path(args.run_dir)
            write_json_atomic(Path(args.out) if args.out else (run_dir if run_dir.is_dir() else run_dir.parent)
                              / "cores.json", rows)
            sys.stdout.write(table(rows))
        elif args.command == "scale-map":
            render_scale_maps(args.out)
        else:
            report = sweep_report(args.sweep_dir, args.out, plots=not args.no_plots)
            sys.stdout.write(report.markdown)
    except ReportError as e:
        logging.getLogger("pipesgd_lab.report").error("error: %s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
