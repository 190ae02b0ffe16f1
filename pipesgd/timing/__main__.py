"""``python -m pipesgd.timing predict ...``: predicted iteration time of every mode, no workers needed.
Measuring the constants is ``python -m pipesgd_lab.bench.calibrate_cli`` (bench/ reads timing/, never
the other way round).

Values for ``predict`` come from, in order of precedence: an explicit flag, the ``--calibration``
file, the defaults (10gbit, 50us, γ = 0, no compression cost, no CPU interference).

``python -m pipesgd.timing map ...``: each scheme's step on a cluster and the winner, from presets
with cited sources or the same flags (docs/scale-map.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

from .calibration import DEFAULT_BANDWIDTH, DEFAULT_LATENCY, load_calibration, load_measured_step
from ..registry import registry
from .model import DDP_BUCKET_CAP_BYTES, DDP_FIRST_BUCKET_BYTES, FP32_BYTES, MODEL_PARAMS, Link, predict
from .presets import BACKWARD_SHARE, GPUS, LINKS, MODELS, compute_preset, link_preset
from .rounds import FILL, H_CANDIDATES
from .scale import (ALL_ARMS, ARMS, TIE, Scenario, arm_rows, family_verdict, replica_rows, round_h, round_rows,
                    summarize)
from .units import format_bandwidth, parse_bandwidth, parse_latency


def _arg(convert: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse ``type`` whose ValueError text (which names the bad string) reaches the user."""

    def parse(text: str) -> object:
        try:
            return convert(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = convert.__name__
    return parse


def _int_at_least(low: int) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise ValueError(f"expected an integer >= {low}, got {text!r}")
        return value

    return _arg(convert)


def _float_at_least(low: float, high: float = float("inf")) -> Callable[[str], float]:
    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
        if not low <= value <= high:
            raise ValueError(f"expected a number in [{low:g}, {high:g}], got {text!r}")
        return value

    return _arg(convert)


def _kappa(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    known = list(registry("compressor"))
    if not sep or name not in known:
        raise ValueError(f"expected NAME=SECONDS with NAME in {known}, got {text!r}")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"expected NAME=SECONDS, got {text!r}") from None
    if not seconds >= 0:
        raise ValueError(f"seconds per byte must be >= 0, got {text!r}")
    return name, seconds


def _compressor(text: str):
    """``NAME`` or ``NAME:KEY=VALUE,...`` (integer values): a registered compressor built with
    those options, e.g. ``int8:block_size=0``."""
    name, _, options = text.partition(":")
    kwargs = {}
    for item in filter(None, options.split(",")):
        key, sep, value = item.partition("=")
        try:
            kwargs[key] = int(value)
        except ValueError:
            raise ValueError(f"expected NAME:KEY=INTEGER,..., got {text!r}") from None
        if not sep:
            raise ValueError(f"expected NAME:KEY=INTEGER,..., got {text!r}")
    try:
        return registry("compressor").get(name)(**kwargs)
    except TypeError as e:
        raise ValueError(f"compressor {text!r}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipesgd.timing",
                                     description="Pipe-SGD α–β–γ timing model (docs/timing-model.md).")
    commands = parser.add_subparsers(dest="command", required=True)
    pr = commands.add_parser("predict", help="table of predicted iteration times for every mode")
    size = pr.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=_int_at_least(0), help="trainable parameters (fp32 gradient)")
    size.add_argument("--model", choices=sorted(MODEL_PARAMS), help="a pipesgd model, 10 classes")
    pr.add_argument("--workers", type=_int_at_least(1), required=True, help="p, number of workers")
    pr.add_argument("--bandwidth", type=_arg(parse_bandwidth),
                    help=f"per-worker link rate, e.g. 100mbit, 1gbit (default {DEFAULT_BANDWIDTH})")
    pr.add_argument("--latency", type=_arg(parse_latency),
                    help=f"α per message, e.g. 50us, 0.5ms (default {DEFAULT_LATENCY})")
    pr.add_argument("--gamma", type=_float_at_least(0), help="γ, seconds per byte of reduction (default 0)")
    pr.add_argument("--compute-ms", type=_float_at_least(0), help="forward+backward per iteration")
    pr.add_argument("--update-ms", type=_float_at_least(0), help="optimizer step (default 0)")
    pr.add_argument("--width", type=_int_at_least(1), default=2, help="pipe width K (default 2)")
    pr.add_argument("--compressor", type=_arg(_compressor), action="append", metavar="NAME[:KEY=VALUE,...]",
                    help=f"one of {', '.join(registry('compressor'))}, with options (int8:block_size=0); repeat "
                         "to pick several (default: all, with their defaults)")
    pr.add_argument("--compress-s-per-byte", type=_arg(_kappa), action="append", default=[],
                    metavar="NAME=SECONDS", help="κ: compress+decompress cost per uncompressed byte")
    pr.add_argument("--calibration", metavar="FILE", help="JSON written by `calibrate`")
    pr.add_argument("--overlap-slowdown", type=_float_at_least(1),
                    help="how much slower compute runs while a reduction is in flight (default 1)")
    _barrier_args(pr)
    pr.add_argument("--forward-fraction", type=_float_at_least(0, 1), default=1 / 3,
                    help="share of compute spent in forward (DDP overlap; default 1/3)")
    pr.add_argument("--iterations", type=_int_at_least(0), help="also print total seconds for T iterations")
    pr.add_argument("--per-node", type=_int_at_least(1), default=1,
                    help="ranks per node: adds hierarchical rows when 1 < G < workers")
    pr.add_argument("--intra-bandwidth", type=_arg(parse_bandwidth), help="intra-node rate (default: --bandwidth)")
    pr.add_argument("--intra-latency", type=_arg(parse_latency), help="intra-node α (default: --latency)")
    pr.add_argument("--bucket-mb", type=_float_at_least(0), default=DDP_BUCKET_CAP_BYTES / 2**20,
                    help="DDP bucket_cap_mb (default 25; 0 = one bucket)")
    pr.add_argument("--json", action="store_true", help="print the rows as JSON")
    _add_map_parser(commands)

    return parser


def _resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """Merge flags, calibration file and defaults into the arguments of :func:`predict`."""
    cal = _calibration(parser, args.calibration)
    if args.compute_ms is None and "compute_ms" not in cal:
        parser.error("argument --compute-ms is required unless --calibration provides compute_ms")
    if args.per_node > 1 and args.workers % args.per_node:
        parser.error(f"argument --per-node: {args.per_node} does not divide --workers {args.workers}")
    if args.bandwidth is not None:
        beta = 8.0 / args.bandwidth
    else:
        beta = cal.get("beta_s_per_byte", 8.0 / parse_bandwidth(DEFAULT_BANDWIDTH))
    alpha = args.latency if args.latency is not None else cal.get("alpha_s", parse_latency(DEFAULT_LATENCY))
    gamma = args.gamma if args.gamma is not None else cal.get("gamma_s_per_byte", 0.0)
    link = Link(alpha, beta, gamma)
    intra = None
    if args.intra_bandwidth is not None or args.intra_latency is not None:
        intra = Link(args.intra_latency if args.intra_latency is not None else alpha,
                     8.0 / args.intra_bandwidth if args.intra_bandwidth is not None else beta, gamma)
    kappas = dict(cal.get("compress_s_per_byte", {}))
    kappas.update(dict(args.compress_s_per_byte))
    compute_ms = args.compute_ms if args.compute_ms is not None else cal["compute_ms"]
    update_ms = args.update_ms if args.update_ms is not None else cal.get("update_ms", 0.0)
    slowdown = args.overlap_slowdown if args.overlap_slowdown is not None else cal.get("overlap_slowdown", 1.0)
    return dict(numel=args.params if args.params is not None else MODEL_PARAMS[args.model], p=args.workers,
                link=link, compute_s=compute_ms / 1e3, update_s=update_ms / 1e3, width=args.width,
                compressors=args.compressor, compress_s_per_byte=kappas,
                forward_fraction=args.forward_fraction, overlap_slowdown=slowdown, iterations=args.iterations,
                per_node=args.per_node, intra=intra, barrier_s=_barrier_s(args, cal), buffers=args.buffers,
                bucket_cap_bytes=args.bucket_mb * 2**20 if args.bucket_mb > 0 else None,
                first_bucket_bytes=min(DDP_FIRST_BUCKET_BYTES, args.bucket_mb * 2**20 or DDP_FIRST_BUCKET_BYTES))


def report(inputs: dict, rows: list[dict]) -> None:
    link: Link = inputs["link"]
    nbytes = FP32_BYTES * inputs["numel"]
    print(f"# M = {inputs['numel']:,} params = {nbytes:,} B fp32, p = {inputs['p']}, "
          f"link {format_bandwidth(link.bits_per_second)} (β = {link.beta:.3g} s/B), α = {link.alpha:.3g} s, "
          f"γ = {link.gamma:.3g} s/B, compute {inputs['compute_s'] * 1e3:g} ms, "
          f"update {inputs['update_s'] * 1e3:g} ms, overlap slowdown {inputs['overlap_slowdown']:g}")
    columns = ["mode", "width", "algorithm", "compressor", "ratio", "comm_ms", "exposed_ms", "iter_ms",
               "speedup_vs_sync"] + (["total_s"] if inputs["iterations"] is not None else [])
    cells = [[_cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(columns, widths))))
    for r in cells:
        print("  ".join(v.ljust(w) if i < 4 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))


def _gpu(text: str) -> str:
    """A GPU preset's name, or the path of a measured step_times.json."""
    if text in GPUS or os.path.isfile(text):
        return text
    raise argparse.ArgumentTypeError(f"one of {list(GPUS)} or a step_times.json written by make gpu-check, "
                                     f"got {text!r}")


def _arm_list(text: str) -> tuple[str, ...]:
    arms = tuple(ALL_ARMS) if text == "all" else tuple(a.strip() for a in text.split(",") if a.strip())
    unknown = [a for a in arms if a not in ALL_ARMS]
    if unknown or not arms:
        raise ValueError(f"{text!r}: arms must be among {', '.join(ALL_ARMS)}, or all")
    return arms


def _add_map_parser(commands) -> None:
    mp = commands.add_parser("map", help="each scheme's predicted step on a cluster, and the winner",
                             description=f"Predicted step time of each arm ({', '.join(ARMS)}; built from the "
                             "registered modes and compressors) for one model, GPU and link; presets cite their "
                             "sources in docs/scale-map.md.")
    size = mp.add_mutually_exclusive_group(required=True)
    size.add_argument("--model", choices=sorted(MODELS), help="model preset (parameter count and layer shapes)")
    size.add_argument("--params", type=_int_at_least(1), help="trainable parameters (fp32 gradient)")
    mp.add_argument("--gpu", type=_gpu, metavar="{%s} or FILE" % ",".join(GPUS),
                    help="with --model: that GPU's published step time and batch, or the step time a GPU "
                    "measured (the step_times.json `make gpu-check` writes; its backward share too)")
    mp.add_argument("--compute-ms", type=_float_at_least(0), help="forward+backward+optimizer per step, one GPU")
    mp.add_argument("--backward-share", type=_float_at_least(0, 1),
                    help=f"share of compute in backward (default {BACKWARD_SHARE:.3g}: backward = 2x forward)")
    mp.add_argument("--update-ms", type=_float_at_least(0), help="optimizer step outside --compute-ms (default 0)")
    mp.add_argument("--workers", type=_int_at_least(2), required=True, help="p, GPUs in data parallel")
    mp.add_argument("--link", choices=sorted(LINKS), help="link preset (rate and latency) between GPUs")
    mp.add_argument("--bandwidth", type=_arg(parse_bandwidth), help="per-GPU link rate, e.g. 25gbit")
    mp.add_argument("--latency", type=_arg(parse_latency), help="α per message, e.g. 14us")
    mp.add_argument("--per-node", type=_int_at_least(1), default=1,
                    help="GPUs per node: offers the hierarchical allreduce to every arm when 1 < G < workers")
    mp.add_argument("--intra", choices=sorted(LINKS), help="link preset inside a node (e.g. nvlink-a100)")
    mp.add_argument("--intra-bandwidth", type=_arg(parse_bandwidth), help="intra-node rate")
    mp.add_argument("--intra-latency", type=_arg(parse_latency), help="intra-node α")
    mp.add_argument("--powersgd-rank", type=_int_at_least(1), default=2, help="PowerSGD hook rank (default 2)")
    mp.add_argument("--calibration", metavar="FILE", help="JSON written by `calibrate`: this machine's "
                    "α, β, γ, κ, compute, update, overlap slowdown and PowerSGD's s/FLOP (flags win over it)")
    mp.add_argument("--powersgd-s-per-flop", type=_float_at_least(0),
                    help="seconds per FLOP of PowerSGD's matmuls and QR (default: the calibration's, else 0: "
                    "not modelled)")
    mp.add_argument("--overlap-slowdown", type=_float_at_least(1), help="compute slowdown beside comm (default 1)")
    _barrier_args(mp)
    mp.add_argument("--compress-s-per-byte", type=_arg(_kappa), action="append", default=[],
                    metavar="NAME=SECONDS", help="κ: compress+decompress cost per uncompressed byte")
    mp.add_argument("--arms", type=_arg(_arm_list), default=tuple(ARMS), metavar="ARM,...|all",
                    help=f"the arms to compare (default: {','.join(ARMS)}); all: also "
                         f"{', '.join(a for a in ALL_ARMS if a not in ARMS)}")
    mp.add_argument("--json", action="store_true", help="print inputs, rows and summary as JSON")


def _calibration(parser: argparse.ArgumentParser, path: str | None) -> dict:
    """The ``--calibration`` file's values ({} without one); a bad file is a usage error naming it."""
    if path is None:
        return {}
    try:
        return load_calibration(path)
    except (OSError, ValueError) as e:
        parser.error(f"argument --calibration: {e}")


def _barrier_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--barrier-ms", type=_float_at_least(0),
                        help="what a blocking collective costs a step beyond its bytes (the ranks' jitter and "
                        "its latency; default: the calibration's barrier_s, else 0: not modelled)")
    parser.add_argument("--buffers", action="store_true",
                        help="the model has buffers (BatchNorm statistics) broadcast every step: a barrier more")


def _barrier_s(args: argparse.Namespace, cal: dict) -> float:
    return args.barrier_ms / 1e3 if args.barrier_ms is not None else cal.get("barrier_s", 0.0)


def _map_scenario(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Scenario, dict]:
    """Flags, presets and the calibration file -> the :class:`Scenario` and a description of where
    each input came from. Flags win over the calibration file, which wins over presets."""
    cal = _calibration(parser, args.calibration)
    model = MODELS.get(args.model)
    params = model.params if model else args.params
    sources = {"model": f"{args.model} preset" if model else "--params"}
    compute_ms = args.compute_ms
    if args.gpu is not None:
        if model is None:
            parser.error("argument --gpu: needs --model (a GPU's step time is for one model and batch)")
        if compute_ms is not None:
            parser.error("argument --gpu: give either --gpu or --compute-ms, not both")
        try:
            if args.gpu in GPUS:
                cell = compute_preset(model.name, args.gpu)
            else:
                cell, measured_share = load_measured_step(args.gpu, model.name)
                if args.backward_share is None:
                    args.backward_share = measured_share
        except ValueError as e:
            parser.error(f"argument --gpu: {e}")
        compute_ms = cell.step_ms
        sources["compute"] = f"{cell.gpu}, batch {cell.batch}, {cell.precision}: {cell.throughput:g} {cell.unit}"
    elif compute_ms is None:
        compute_ms = cal.get("compute_ms")
    if compute_ms is None:
        parser.error("argument --compute-ms is required unless --gpu or --calibration provides it")
    sources.setdefault("compute", "--compute-ms" if args.compute_ms is not None else "calibration")
    if args.link is not None and (args.bandwidth is not None or args.latency is not None):
        parser.error("argument --link: give either --link or --bandwidth/--latency, not both")
    if args.link is not None:
        preset = link_preset(args.link)
        link = Link.from_bandwidth(preset.bits_per_second, preset.latency_s, cal.get("gamma_s_per_byte", 0.0))
    elif args.bandwidth is not None or "beta_s_per_byte" in cal:
        beta = 8.0 / args.bandwidth if args.bandwidth is not None else cal["beta_s_per_byte"]
        if args.latency is None and "alpha_s" not in cal:
            parser.error("argument --latency is required with --bandwidth (or use --link)")
        alpha = args.latency if args.latency is not None else cal["alpha_s"]
        link = Link(alpha, beta, cal.get("gamma_s_per_byte", 0.0))
    else:
        parser.error(f"a link is required: --link one of {sorted(LINKS)}, or --bandwidth and --latency")
    intra = None
    if args.intra is not None and (args.intra_bandwidth is not None or args.intra_latency is not None):
        parser.error("argument --intra: give either --intra or --intra-bandwidth/--intra-latency, not both")
    if args.intra is not None:
        preset = link_preset(args.intra)
        intra = Link.from_bandwidth(preset.bits_per_second, preset.latency_s)
    elif args.intra_bandwidth is not None:
        intra = Link(args.intra_latency if args.intra_latency is not None else link.alpha, 8.0 / args.intra_bandwidth)
    elif args.intra_latency is not None:
        parser.error("argument --intra-latency: needs --intra-bandwidth")
    if intra is not None and not 1 < args.per_node < args.workers:
        parser.error(f"an intra-node link needs 1 < --per-node < --workers, got --per-node {args.per_node} "
                     f"--workers {args.workers} (on one node, pass its fabric as --link)")
    kappas = dict(cal.get("compress_s_per_byte", {}))
    kappas.update(dict(args.compress_s_per_byte))
    backward = args.backward_share if args.backward_share is not None else BACKWARD_SHARE
    update_ms = args.update_ms if args.update_ms is not None else cal.get("update_ms", 0.0)
    slowdown = args.overlap_slowdown if args.overlap_slowdown is not None else cal.get("overlap_slowdown", 1.0)
    try:
        scenario = Scenario(params, args.workers, link, compute_ms / 1e3, backward, update_ms / 1e3,
                            model.shapes if model else None, args.powersgd_rank, args.per_node, intra,
                            slowdown, kappas, powersgd_s_per_flop=args.powersgd_s_per_flop
                            if args.powersgd_s_per_flop is not None else cal.get("powersgd_s_per_flop", 0.0),
                            barrier_s=_barrier_s(args, cal), buffers=args.buffers)
    except ValueError as e:
        parser.error(str(e))
    return scenario, sources


def _map(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    scenario, sources = _map_scenario(parser, args)
    rows = arm_rows(scenario, args.arms)
    summary = summarize(rows)
    s = scenario
    h = round_h(s)
    rounds = round_rows(s, h) if h is not None else replica_rows(s, None)  # nodes as replicas may hide at some H
    verdict = family_verdict(rows, rounds, h)
    if args.json:
        inputs = {"params": s.params, "workers": s.p, "bandwidth_bit_s": s.link.bits_per_second,
                  "latency_s": s.link.alpha, "gamma_s_per_byte": s.link.gamma, "compute_ms": s.compute_s * 1e3,
                  "backward_share": s.backward_share, "update_ms": s.update_s * 1e3, "per_node": s.per_node,
                  "intra_bandwidth_bit_s": s.intra.bits_per_second if s.intra else None,
                  "overlap_slowdown": s.overlap_slowdown, "powersgd_rank": s.powersgd_rank,
                  "powersgd_bytes": s.powersgd_bytes_from, "powersgd_s_per_flop": s.powersgd_s_per_flop, "barrier_s": s.barrier_s, "buffers": s.buffers,
                  "sources": sources}
        print(json.dumps({"inputs": inputs, "rows": rows, "summary": summary, "rounds": rounds,
                          "family": verdict}, indent=1))
        return 0
    intra = (f", {s.per_node} per node, intra {format_bandwidth(s.intra.bits_per_second)} α {s.intra.alpha:.3g} s"
             if s.intra else (f", {s.per_node} per node" if s.per_node > 1 else ""))
    print(f"# M = {s.params:,} params = {s.nbytes:,} B fp32 ({sources['model']}), p = {s.p}, link "
          f"{format_bandwidth(s.link.bits_per_second)} α {s.link.alpha:.3g} s{intra}, compute "
          f"{s.compute_s * 1e3:.4g} ms ({sources['compute']}), backward {s.backward_share:.3g}, update "
          f"{s.update_s * 1e3:g} ms, overlap slowdown {s.overlap_slowdown:g}")
    print(f"# ddp-powersgd: rank {s.powersgd_rank}, {s.powersgd_bytes_from}; its matmuls and QR "
          + (f"at {s.powersgd_s_per_flop:.3g} s/FLOP" if s.powersgd_s_per_flop else "not modelled (0 s/FLOP)"))
    columns = ["arm", "algorithm", "ratio", "iter_ms", "speedup_vs_sync"]
    cells = [[_cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    for line in [columns, *cells]:
        print("  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(line, widths))))
    if summary["pipe_over_ddp"] is None:
        print(f"winner: {summary['winner']}")
    else:
        print(f"winner: {summary['winner']}; best pipe arm {summary['best_pipe']} is "
              f"{summary['pipe_over_ddp']:.2f}x the best DDP arm {summary['best_ddp']}")
    _print_rounds(rounds, h, verdict)
    return 0


def _print_rounds(rounds: list[dict], h: int | None, verdict: dict) -> None:
    """The round arms at the smallest H that hides the int8 exchange, and which family wins."""
    if h is None:
        print(f"rounds: no H of {', '.join(map(str, H_CANDIDATES))} hides the int8 exchange under a round's compute"
              + ("; with each node one replica of its ranks:" if rounds else ""))
    else:
        print(f"rounds at H = {h} (the smallest of {', '.join(map(str, H_CANDIDATES))} whose int8 exchange takes at "
              f"most {FILL:.0%} of a round's compute; torchft and the streaming arms also at 2H and 4H; nodes as "
              "replicas also at their own H):")
    if rounds:
        columns = ["arm", "sync_every", "fragments", "sync_delay", "iter_ms", "utilization"]
        cells = [[_cell(row[c]) for c in columns] for row in rounds]
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
        for line in [columns, *cells]:
            print("  ".join(v.ljust(w) if i < 1 else v.rjust(w) for i, (v, w) in enumerate(zip(line, widths))))
    if verdict["family"] is not None:
        with_h = (f" at H = {verdict['h']}, landing {verdict['lateness']} step{'s' * (verdict['lateness'] != 1)} "
                  "after its launch" if verdict["h"] else "")
        print(f"family: {verdict['family']} ({verdict['arm']}{with_h}, {verdict['iter_ms']:.2f} ms per step; ties "
              f"within {TIE:.0%} go to the arm whose average lands soonest, then to the family that exchanges "
              "most often)")


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "map":
        return _map(parser, args)
    inputs = _resolve(parser, args)
    try:
        rows = predict(**inputs)
    except ValueError as e:
        parser.error(str(e))
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        report(inputs, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
