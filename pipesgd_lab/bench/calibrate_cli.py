"""``python -m pipesgd_lab.bench.calibrate_cli``: measure the timing model's constants on a real process
group and write the JSON ``pipesgd.timing.load_calibration`` reads (pipesgd_lab/bench/calibrate.py does
the measuring; its workers import it from there, never from ``__main__``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from pipesgd import launch
from pipesgd.timing.__main__ import _arg, _int_at_least

from .calibrate import DEFAULT_SIZES, QUICK_SIZES, CalibrationSpec, calibrate, parse_size


def _sizes(text: str) -> list[int]:
    return [parse_size(part) for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    ca = argparse.ArgumentParser(prog="python -m pipesgd_lab.bench.calibrate_cli",
                                 description="Measure the timing model's constants on a real Gloo group "
                                 "(docs/timing-model.md, 'Calibration'). Starts --workers local processes, "
                                 "or joins the job under torchrun / pipesgd_lab.emulate.")
    ca.add_argument("--workers", type=_int_at_least(2), default=2,
                    help="local worker processes (default 2; ignored under torchrun/emulate)")
    ca.add_argument("--model", default="resnet20", help="a conf/model name (default resnet20)")
    ca.add_argument("--model-override", action="append", default=[], metavar="KEY=VALUE",
                    help="model config override, e.g. 'hidden=[1024,256]' for mlp (repeatable)")
    ca.add_argument("--data", help="conf/data name for the input shape (default: mnist for mlp/cnn, else cifar10)")
    ca.add_argument("--batch-size", type=_int_at_least(1), default=32, help="per-worker batch (default 32)")
    ca.add_argument("--threads", type=_int_at_least(1), default=1, help="torch threads per worker (default 1)")
    ca.add_argument("--sizes", type=_arg(_sizes), help="ping-pong sizes in bytes, e.g. 4,1k,64k,1m,4m")
    ca.add_argument("--repeats", type=_int_at_least(1), help="timed repetitions per measurement (default 10)")
    ca.add_argument("--overlap-steps", type=_int_at_least(1), help="compute steps timed under comm (default 10)")
    ca.add_argument("--quick", action="store_true", help="small sizes, few repeats: seconds, for tests")
    ca.add_argument("--out", help="output JSON (default: calibration.json, or in hydra.run.dir)")
    ca.add_argument("run_dir", nargs="*", metavar="hydra.run.dir=DIR",
                    help="where to write calibration.json when run by pipesgd_lab.emulate")
    return ca


def _calibrate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Options -> CalibrationSpec, run it, print the file written."""
    run_dir = None
    for extra in args.run_dir:
        key, sep, value = extra.lstrip("+").partition("=")
        if key != "hydra.run.dir" or not sep:
            parser.error(f"unexpected argument {extra!r}: calibrate takes options, and hydra.run.dir=DIR "
                         "(as pipesgd_lab.emulate passes it) for where to write calibration.json")
        run_dir = value
    out = args.out or (os.path.join(run_dir, "calibration.json") if run_dir else "calibration.json")
    try:
        spec = CalibrationSpec(
            model=args.model, data=args.data, model_overrides=tuple(args.model_override),
            batch_size=args.batch_size, threads=args.threads,
            sizes=tuple(args.sizes) if args.sizes else (QUICK_SIZES if args.quick else DEFAULT_SIZES),
            repeats=args.repeats or (6 if args.quick else 12), warmup=2 if args.quick else 3,
            overlap_steps=args.overlap_steps or (4 if args.quick else 12), rounds=2 if args.quick else 3,
            command=tuple(sys.argv))
    except ValueError as e:
        parser.error(str(e))
    workers = int(os.environ["WORLD_SIZE"]) if launch.under_torchrun() else args.workers
    if workers < 2:
        parser.error(f"argument --workers: calibrate needs at least 2 workers, got {workers}")
    try:
        calibrate(spec, out, workers)
    except launch.WorkerFailed as e:
        logging.getLogger(__name__).error("%s", e)
        return 1
    if not launch.under_torchrun() or os.environ.get("RANK") == "0":
        print(out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    return _calibrate(parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
