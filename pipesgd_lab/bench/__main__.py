"""``python -m pipesgd_lab.bench [options] [Hydra overrides for every training run]``.

Writes results/benchmarks/benchmarks.json (a list of cells; a subset run replaces only its own cells) and
regenerates the tables of docs/benchmarks.md (``--grid ring-scaling``: results/ring-scaling/ring-scaling.json and
docs/ring-scaling.md). Emulated-link cells need root (pipesgd_lab.emulate); without it they are skipped with a warning.
Exit status 1 if any cell failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pipesgd_lab.emulate.netns import DEFAULT_MTU

from .grid import GRIDS, quick_grid, select
from .render import write_markdown
from .runner import Settings, Stopped, merge, run_cells, save, stop_on_signals

log = logging.getLogger("pipesgd_lab.bench")
ROOT = Path()  # defaults are under the current directory (run from a clone's root to update its docs/)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipesgd_lab.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every training run, e.g. data.root=PATH")
    p.add_argument("--grid", choices=sorted(GRIDS), default="full",
                   help="which cells: the suite (full, default; docs/benchmarks.md), the allreduce algorithms "
                   "at p = 4, 8, 16 (ring-scaling; docs/ring-scaling.md) or ResNet-20's link-rate sweep (crossover: "
                   "6 rates x p = 2, 4 x 8 arms in interleaved rounds, 3 by default; docs/crossover.md)")
    p.add_argument("--only", help="comma-separated shell patterns over cell names, e.g. 'resnet20/p2/*,allreduce/*'")
    p.add_argument("--quick", action="store_true",
                   help="10 steps after 3 skipped, 1 repeat, 5 collectives, quick calibration; without "
                   "--only, on a small slice (p=2, loopback + 100mbit): minutes, to check the machinery")
    p.add_argument("--list", action="store_true", help="print the selected cells' names and exit")
    p.add_argument("--steps", type=int, help="measured steps per run (default 40; quick 10)")
    p.add_argument("--skip", type=int, help="warm-up steps left out of the medians (default 10; quick 3)")
    p.add_argument("--repeats", type=int, help="runs per training cell, each a new process (default 2; quick 1; "
                   "--grid crossover 3)")
    p.add_argument("--interleave", action="store_true",
                   help="run the repeats as rounds: every selected cell once before the next round "
                   "(always on with --grid crossover)")
    p.add_argument("--calibrate-each-round", action="store_true",
                   help="with interleaved rounds: calibrate every condition afresh in each round, so the "
                   "model's compute comes from the rounds it predicts (always on with --grid crossover)")
    p.add_argument("--allreduce-repeats", type=int, help="timed collectives per allreduce cell (default 20; quick 5)")
    p.add_argument("--out", type=Path, help="JSON list of cells (default results/benchmarks/benchmarks.json; "
                   "another --grid: results/<grid>/<grid>.json)")
    p.add_argument("--md", type=Path, help="markdown to regenerate (default docs/benchmarks.md, or docs/<grid>.md)")
    p.add_argument("--fresh", action="store_true", help="start a new JSON instead of merging into --out")
    p.add_argument("--dir", type=Path, help="run dirs, logs, calibrations (default outputs/bench/<time>)")
    p.add_argument("--calibrations", type=Path, help="reuse <workload>-p<p>-<link>.json files from this dir")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per command (default 1800)")
    p.add_argument("--mtu", type=int, default=DEFAULT_MTU,
                   help=f"MTU of the emulated links (default {DEFAULT_MTU}; 1500: the earlier, CPU-hungry link)")
    p.add_argument("--probe-s", type=float, default=None,
                   help="seconds of the host-speed probe just before and just after each training run (fixed "
                        "matrix products on every core: whether the host held still; default 1, --quick 0; 0: none)")
    p.add_argument("--render-only", action="store_true", help="regenerate --md from --out and exit")
    return p


def _at_least(parser: argparse.ArgumentParser, name: str, value: int | None, low: int) -> None:
    if value is not None and value < low:
        parser.error(f"argument --{name}: must be an integer >= {low}, got {value}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    stem = "benchmarks" if args.grid == "full" else args.grid
    args.out, args.md = args.out or ROOT / "results" / stem / f"{stem}.json", args.md or ROOT / "docs" / f"{stem}.md"
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    existing = json.loads(args.out.read_text()) if args.out.exists() and not args.fresh else []
    if args.render_only:
        write_markdown(args.md, existing)
        print(args.md)
        return 0
    for name, low in (("steps", 1), ("skip", 0), ("repeats", 1), ("allreduce_repeats", 1)):
        _at_least(parser, name.replace("_", "-"), getattr(args, name), low)
    if args.probe_s is not None and args.probe_s < 0:
        parser.error(f"argument --probe-s: must be >= 0 seconds (0: no probe), got {args.probe_s}")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"unexpected argument(s) {bad}: positional arguments are Hydra overrides key=value")
    if args.calibrate_each_round and not (args.interleave or args.grid == "crossover"):
        parser.error("argument --calibrate-each-round: needs rounds; add --interleave")
    try:
        grid = GRIDS[args.grid]()
        cells = select(grid, args.only) if args.only else (
            quick_grid() if args.quick and args.grid == "full" else grid)
    except ValueError as e:
        parser.error(str(e))
    if args.list:
        print("\n".join(c.name for c in cells))
        return 0
    cells = _runnable(cells)
    q, crossover = args.quick, args.grid == "crossover"
    settings = Settings(
        bench_dir=(args.dir or ROOT / "outputs" / "bench" / time.strftime("%Y-%m-%d_%H-%M-%S")).resolve(),
        steps=args.steps or (10 if q else 40), skip=args.skip if args.skip is not None else (3 if q else 10),
        repeats=args.repeats or (1 if q else 3 if crossover else 2), interleave=args.interleave or crossover,
        allreduce_repeats=args.allreduce_repeats or (5 if q else 20),
        quick=q, calibration_dir=args.calibrations, overrides=args.overrides, timeout_s=args.timeout_s,
        mtu=args.mtu, calibrate_each_round=args.calibrate_each_round or crossover,
        probe_s=args.probe_s if args.probe_s is not None else (0.0 if q else 1.0))
    log.info("%d cells, run dirs under %s", len(cells), settings.bench_dir)
    started, latest = time.perf_counter(), {}
    order = [c.name for c in grid]
    try:
        with stop_on_signals():
            for record in run_cells(cells, settings):
                latest[record["name"]] = record  # interleaved rounds yield a cell again after each of its runs
                new = list(latest.values())
                # Written after every run, so an interrupted suite keeps what it measured.
                save(args.out, merge(existing, new, order))
                write_markdown(args.md, merge(existing, new, order))
    except Stopped as e:
        log.error("stopped by %s after %.0f s; %d cells kept in %s", e.sig.name, time.perf_counter() - started,
                  len(latest), args.out)
        return 128 + e.sig
    new = list(latest.values())
    failed = sum("error" in r for r in new)
    log.info("%d cells in %.0f s (%d failed): %s, %s", len(new), time.perf_counter() - started, failed, args.out,
             args.md)
    return 1 if failed else 0


def _runnable(cells: list) -> list:
    """Drop emulated cells (with one warning) when network namespaces cannot be built here."""
    if not any(c.emulated for c in cells):
        return cells
    from pipesgd_lab.emulate import EmulateUnavailable, preflight

    try:
        preflight()
    except EmulateUnavailable as e:
        skipped = [c for c in cells if c.emulated]
        log.warning("skipping %d emulated-link cells: %s", len(skipped), e)
        return [c for c in cells if not c.emulated]
    return cells


if __name__ == "__main__":
    sys.exit(main())
