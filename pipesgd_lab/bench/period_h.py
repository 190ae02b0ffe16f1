"""``python -m pipesgd_lab.bench.period_h``: the period-H study's tables (docs/period-h.md, "Against
torchft's DiLoCo"), from what the time-to-accuracy tool wrote (``pipesgd_lab.bench.tta``: its timing
file and its curve records). Per link and arm: the measured step (a round arm's: the mean over whole
rounds), compute utilization (the run's own compute step over its step), bytes sent per step
(the timing row's, from its run's summary) and the timing model's prediction from that compute step (each run's
own median forward + backward; the compute-alone arm's step beside it); per arm the
final validation loss at equal steps over its seeds; per link the time to sync's final loss + 1 %,
composed as the tool composes it (each arm's loss curve on loopback, its step time on the link, the
evaluations at the link's median evaluation time). ``--stand-in ARM=CURVE`` prices an arm timed
without a curve of its own on another arm's curve (said in the output); ``--timed-as CURVE=ARM`` the
reverse: prices CURVE's loss curve at ARM's step times, for an arm whose exchange is ARM's (the same
fragments, H, delay and compressor; only the arithmetic at a landing differs) and that was not timed
under its own name. Writes ``--json`` and
``--plot`` (utilization against bandwidth); prints the tables. The validation records in ``--records``
(an arm run end to end on a shaped link, ``--phase validate``) are composed against their own clocks.

``--probe DIR`` gives the model each link's rate as measured, per way of sending: the
``pipesgd_lab.bench.allreduce`` records in DIR (one per link and way, run under
``pipesgd_lab.emulate``) of pipesgd's ring, which every pipesgd arm sends with on Gloo, of Gloo's
own allreduce on one buffer (``native``), which DDP's bucket is, and of Gloo's allreduce once per
parameter tensor (``native-tensors``, the bench's ``tensors=gpt-shakespeare``), which torchft's
DiLoCo does. Without it every arm is priced at the link's nominal rate times TCP's share of a
jumbo frame."""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from pipesgd.observability.runinfo import git_commit, write_json_atomic
from pipesgd.timing.model import Link, comm_time, compression_ratio
from pipesgd.timing.presets import MODELS
from pipesgd.timing.rounds import round_iter_ms
from pipesgd.timing.scale import Scenario, arm_rows
from pipesgd.timing.units import parse_latency
from pipesgd_lab.emulate.netns import parse_rate

from . import tta_compose as compose
from .grid import LOOPBACK
from .tta_arms import ARMS, arm_mode, sync_every
from .tta_report import timing_by_link

log = logging.getLogger("pipesgd_lab.bench.period_h")
MODEL = MODELS["gpt-shakespeare"]
FRAME_CEILING = 8948 / 9014
"""TCP goodput over a tbf-shaped link at MTU 9000 (docs/emulated-cluster.md): the rate the model is given."""
PER_STEP_MAP_ARMS = {"ddp-fp16": "ddp-fp16", "ddp": "ddp", "ddp-powersgd": "ddp-powersgd",
                     "pipe+lookahead-int8": "pipe-int8", "sync": "sync"}
"""Study arm -> the map's arm that prices it (a staleness rule costs no time)."""
WARMUP_STEPS = {"pipe+lookahead-int8": 300}
SLACKS = (0.01, 0.05, 0.10, 0.20)
"""Targets: sync's final loss plus each share; +1 % is the study's, the looser ones rank the arms
that end above it (the DiLoCo arms at this run length)."""
"""The recipe's synchronous steps of a pipe arm, priced at its own timed warm-up rate."""


def _setting(arm: str, key: str, default: str) -> str:
    return next((o.split("=", 1)[1] for o in ARMS[arm] if o.startswith(f"{key}=")), default)


SENDS = {"ddp": "native", "torchft_diloco": "native-tensors"}
"""Mode -> how its exchange is sent, where it is not pipesgd's ring on Gloo (``comm=auto``): DDP's
bucket (one buffer: this model fits one) through Gloo's allreduce, torchft's pseudo-gradient through
Gloo's allreduce once per parameter tensor (its DiLoCo's default, ``use_bucketization=False``)."""


def algorithm(arm: str) -> str:
    """How ``arm``'s exchange is sent on this machine: ``ring`` (pipesgd's), ``native`` (Gloo's
    allreduce, one buffer) or ``native-tensors`` (Gloo's, one call per parameter tensor)."""
    return "ring" if arm == compose.COMPUTE_ARM else SENDS.get(arm_mode(arm), "ring")


def _way(record: dict) -> str:
    """The :func:`algorithm` name of an allreduce bench record: its algo, ``-tensors`` where it sent
    a model's tensors one by one."""
    return record["algo"] + ("-tensors" if (record.get("tensors") or 1) > 1 else "")


def probe_links(records: Sequence[dict], latency_s: float) -> dict[tuple[str, str], Link]:
    """(link, way) -> the link as that way of sending measured it (:func:`algorithm`'s names): β
    solved from the median of a ``pipesgd_lab.bench.allreduce`` record's repetitions, priced as one
    ring of its ``world_size`` over all its bytes with α = ``latency_s`` (the model's cost of every
    exchange here; ``loopback`` too). A record without a link or with no repetitions is skipped; two
    records of one (link, way) are refused."""
    links: dict[tuple[str, str], Link] = {}
    for r in records:
        if not r.get("link") or not r.get("seconds"):
            continue
        key = (r["link"], _way(r))
        if key in links:
            raise ValueError(f"two probe records of {key[1]} on {key[0]}: keep one")
        p, nbytes, t = int(r["world_size"]), float(r["bytes"]), statistics.median(r["seconds"])
        fixed = comm_time("ring", nbytes, p, Link(latency_s, 0.0))
        per_beta = comm_time("ring", nbytes, p, Link(0.0, 1.0))
        if t <= fixed:
            raise ValueError(f"probe of {key[1]} on {key[0]}: {t} s is under its latency alone ({fixed} s)")
        links[key] = Link(latency_s, (t - fixed) / per_beta)
    return links


def load_probe(folder: Path) -> list[dict]:
    """Every ``allreduce.json`` record below ``folder`` (the allreduce bench's, one per link and algorithm)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"probe folder {folder} does not exist")
    records = [json.loads(f.read_text()) for f in sorted(folder.rglob("*.json"))]
    return [r for r in records if isinstance(r, dict) and r.get("algo") is not None]


def predicted_ms(arm: str, link: str, compute_ms: float, latency_s: float,
                 measured: dict[tuple[str, str], Link] | None = None) -> float | None:
    """The timing model's step for ``arm`` on ``link`` at the measured compute step (None: not
    priced): at the rate its allreduce measured on that link where ``measured`` has it
    (:func:`probe_links`), else at the nominal rate times TCP's share of a frame (loopback has no
    nominal rate: not priced without a probe)."""
    bw = (measured or {}).get((link, algorithm(arm)))
    if bw is None and link == LOOPBACK:
        return None
    bw = bw or Link.from_bandwidth(parse_rate(link) * FRAME_CEILING, latency_s)
    h = sync_every(arm)
    if h > 1:
        compressor = _setting(arm, "compressor", "none")
        mode = arm_mode(arm)
        width = int(_setting(arm, "trainer.width", "1")) if mode == "pipe" else 1
        return round_iter_ms(mode, "ring", 4 * MODEL.params, 2, bw, compute_ms / 1e3, 0.0, width,
                             compression_ratio(compressor, MODEL.params, 2), sync_every=h,
                             fragments=int(_setting(arm, "trainer.fragments", "1")),
                             sync_delay=int(_setting(arm, "trainer.sync_delay", "0")))
    if arm not in PER_STEP_MAP_ARMS:
        return None
    rows = arm_rows(Scenario(MODEL.params, 2, bw, compute_ms / 1e3, shapes=MODEL.shapes), [PER_STEP_MAP_ARMS[arm]])
    return rows[0]["iter_ms"]


def _bytes_per_step(row: dict) -> float | None:
    """Bytes one worker sends per step in the timing run: the row's ``sent_bytes`` (its summary's
    bytes per exchange, the median of the steps that sent) times the exchanges per step (F fragments
    every H steps for a round arm); None where the row does not say."""
    if row.get("sent_bytes") is None:
        return None
    arm = row["arm"]
    return row["sent_bytes"] * (int(_setting(arm, "trainer.fragments", "1")) / sync_every(arm) if arm in ARMS else 1.0)


def link_rows(rows: Sequence[dict], latency_s: float,
              measured: dict[tuple[str, str], Link] | None = None) -> dict[str, list[dict]]:
    """Per link, one row per timed arm: step_ms, compute_ms (the run's own median forward + backward),
    utilization (compute_ms over step_ms, the run's compute-alone step over its step), vs_compute
    (the compute-alone arm's step over this one's), bytes_per_step, predicted_ms (the model at
    compute_ms) and error. A DDP arm's forward + backward holds its allreduce (its buckets run
    inside backward): its compute is the median of the link's other arms' instead."""
    by_link = timing_by_link(list(rows))
    out: dict[str, list[dict]] = {}
    for link, block in by_link.items():
        alone = block["step_ms"].get(compose.COMPUTE_ARM)
        sent, computed = {}, {}
        for r in rows:
            if r["link"] == link:
                sent.setdefault(r["arm"], []).append(_bytes_per_step(r))
                computed.setdefault(r["arm"], []).append(r["median_compute_ms"])
        others = [c for arm, cs in computed.items() if arm_mode(arm) != "ddp" and arm != compose.COMPUTE_ARM for c in cs]
        table = []
        for arm, ms in block["step_ms"].items():
            ddp = arm != compose.COMPUTE_ARM and arm_mode(arm) == "ddp"
            compute = statistics.median(others if ddp and others else computed[arm])
            predicted = predicted_ms(arm, link, compute, latency_s, measured) if arm != compose.COMPUTE_ARM else None
            values = [b for b in sent.get(arm, []) if b is not None]
            table.append({"arm": arm, "sync_every": sync_every(arm), "algorithm": algorithm(arm), "step_ms": ms,
                          "compute_ms": compute,
                          "utilization": compute / ms, "vs_compute": alone / ms if alone else None,
                          "bytes_per_step": statistics.median(values) if values else None,
                          "predicted_ms": predicted, "error": None if predicted is None else (predicted - ms) / ms,
                          "window": block["windows"].get(arm)})
        out[link] = table
    return out


def load_curves(records: Path, ranks_per_replica: int = 1) -> list[dict]:
    """Every complete curve record in ``records`` of runs at ``ranks_per_replica`` ranks per replica
    (a record from before the field: 1): {"name", "seed", "curve", "final"}."""
    runs = []
    for path in sorted(records.glob("*.json")):
        r = json.loads(path.read_text())
        if r.get("kind") == "curve" and r.get("complete") and r.get("ranks_per_replica", 1) == ranks_per_replica:
            runs.append({"name": r["arm"], "seed": r["seed"], "curve": r["curve"], "final": r[f"final_{r['metric']}"],
                         "steps": r["steps"]})
    return runs


def validations(records: Path, ranks_per_replica: int = 1) -> list[dict]:
    """Composed against measured for each ``validate-*.json`` record in ``records`` (an arm run end to
    end on a shaped link by the tool's ``--phase validate``): the steps times the step its bracket's
    timing runs measured (just before and after it, priced as the timing table prices them), plus its
    evaluations at their median time, against the run's own clock at its last evaluation. Only the
    records of runs at ``ranks_per_replica`` ranks per replica: another shape's are its own study's."""
    out = []
    for path in sorted(records.glob("validate-*.json")) if records.is_dir() else []:
        v = json.loads(path.read_text())
        rows = [*(v.get("bracket") or {}).get("before", []), *(v.get("bracket") or {}).get("after", [])]
        if not rows or v["arm"] not in ARMS or v.get("ranks_per_replica", 1) != ranks_per_replica:
            continue
        block = timing_by_link(rows)[v["link"]]
        step_ms = block["step_ms"][v["arm"]]
        row = compose.validation_row(v["arm"], v["link"], v["curve"], v["eval_elapsed_s"], None, step_ms,
                                     block["eval_s"], metric=compose.LOSS)
        window = sorted({(r.get("window") or {}).get("steps") for r in rows} - {None})
        out.append(row | {"step_ms": step_ms, "eval_s": block["eval_s"], "bracket_runs": len(rows),
                          "bracket_steps": window[0] if len(window) == 1 else None,
                          "within": None if row["rel_error"] is None else abs(row["rel_error"]) <= compose.VALIDATION_GOAL,
                          "record": path.name})
    return out


def final_losses(runs: Sequence[dict]) -> dict[str, dict]:
    """Per arm its final losses over seeds: the mean, the sample standard deviation (None for one
    seed), the mean against sync's mean (``vs_sync``) and, seed by seed, against sync's run of the
    same seed (``paired_vs_sync``: {seed: ratio - 1}, only the seeds sync also ran), the spread a
    seed's luck puts on the gap."""
    by_arm: dict[str, dict[int, float]] = {}
    for r in runs:
        by_arm.setdefault(r["name"], {})[r["seed"]] = r["final"]
    sync = by_arm["sync"]
    out = {}
    for arm, seeds in by_arm.items():
        values = [seeds[s] for s in sorted(seeds)]
        out[arm] = {"mean": statistics.fmean(values), "stdev": statistics.stdev(values) if len(values) > 1 else None,
                    "seeds": len(values), "values": values, "seed_ids": sorted(seeds),
                    "vs_sync": statistics.fmean(values) / statistics.fmean(sync.values()) - 1,
                    "paired_vs_sync": {s: seeds[s] / sync[s] - 1 for s in sorted(seeds) if s in sync}}
    return out


def study(rows: Sequence[dict], runs: Sequence[dict], stand_ins: dict[str, str], latency_s: float,
          checks: Sequence[dict] = (), probe: Sequence[dict] = (), timed_as: dict[str, str] | None = None) -> dict:
    """The study's result: per link the arm rows and the composed times to sync's final loss + 1 %;
    ``probe``: allreduce records that give the model each link's measured rate (:func:`probe_links`);
    ``timed_as``: curve arm -> the timed arm whose step times it is priced at."""
    timed_as = timed_as or {}
    measured = probe_links(probe, latency_s)
    finals: dict[str, list[float]] = {}
    for r in runs:
        finals.setdefault(r["name"], []).append(r["final"])
    if "sync" not in finals:
        raise SystemExit("no complete sync curve: the target is sync's final loss + 1 %")
    sync_final = statistics.fmean(finals["sync"])
    target = sync_final * (1 + compose.SAME_LOSS_REL)
    targets = {f"+{slack:.0%}": sync_final * (1 + slack) for slack in SLACKS}
    priced = [*runs, *({**r, "name": arm} for arm, curve in stand_ins.items() for r in runs if r["name"] == curve)]
    by_link = timing_by_link(list(rows))
    links = {}
    for link, table in link_rows(rows, latency_s, measured).items():
        # a curve timed as another arm takes that arm's row, after every median over the link's rows
        table += [{**r, "arm": curve, "timed_as": arm} for curve, arm in timed_as.items() for r in table
                  if r["arm"] == arm]
        block = by_link[link]
        ms = {r["arm"]: r["step_ms"] for r in table}
        composed = compose.compose_link(priced, ms, block["eval_s"], WARMUP_STEPS, {"target": target, **targets},
                                        warmup_at={a: a for a in WARMUP_STEPS}, warmup_ms=block["warmup_ms"],
                                        metric=compose.LOSS)
        links[link] = {"arms": table, "eval_s": block["eval_s"], "time_to_target_s": composed["time_to_target_s"],
                       "time_s": {name: composed["targets"][name]["time_s"] for name in targets},
                       "unpriced": composed["unpriced"], "measured": block["measured"], "commits": block["commits"],
                       "rate_bit_s": {way: measured[(link, way)].bits_per_second
                                      for way in ("ring", "native", "native-tensors") if (link, way) in measured}}
    return {"recipe": "gpt_shakespeare", "steps": sorted({r["steps"] for r in runs}), "target_loss": target,
            "targets": targets,
            "final_loss": final_losses(runs),
            "stand_ins": stand_ins, "timed_as": timed_as, "links": links, "validations": list(checks), "latency_s": latency_s,
            "commit": git_commit()}


def _fmt(v, spec: str = "{:.3g}") -> str:
    return "–" if v is None else spec.format(v)


def tables(result: dict) -> str:
    lines = [f"target: sync's final loss + 1 % = {result['target_loss']:.4f} at {result['steps']} steps", "",
             *(f"{arm}: priced on {curve}'s curve" for arm, curve in result["stand_ins"].items()),
             *(f"{curve}: priced at {arm}'s step times" for curve, arm in (result.get("timed_as") or {}).items()),
             *([""] if result["stand_ins"] or result.get("timed_as") else []),
             "| arm | final loss | sd | vs sync | vs sync, seed by seed | seeds |", "|---|---|---|---|---|---|"]
    for arm, f in sorted(result["final_loss"].items(), key=lambda kv: kv[1]["mean"]):
        paired = ", ".join(f"{v:+.2%}" for v in f["paired_vs_sync"].values()) if arm != "sync" else "–"
        lines.append(f"| {arm} | {f['mean']:.4f} | {_fmt(f['stdev'], '{:.4f}')} | {f['vs_sync']:+.2%} | {paired} | "
                     f"{f['seeds']} |")
    names = list(result["targets"])
    for link, block in result["links"].items():
        if link == LOOPBACK:  # timed for what a sync costs beyond its bytes; nobody trains across it here
            continue
        lines += ["", f"{link}: minutes to sync's final loss plus " + ", ".join(names), "",
                  "| arm | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for arm in sorted(block["time_s"][names[0]], key=lambda a: [block["time_s"][n][a] or 1e12 for n in names][::-1]):
            lines.append(f"| {arm} | " + " | ".join(_fmt(None if block["time_s"][n][arm] is None
                                                         else block["time_s"][n][arm] / 60, "{:.1f}") for n in names) + " |")
    for link, block in result["links"].items():
        rates = ", ".join(f"{algo} {bits / 1e6:.3g} Mbit/s" for algo, bits in (block.get("rate_bit_s") or {}).items())
        lines += ["", f"{link} (evaluation {block['eval_s']:.1f} s" + (f"; the model's rate, as probed: {rates}" if rates
                                                                       else "") + ")", "",
                  "| arm | H | step s | compute s | utilization | MB/step | predicted s | error | to target |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(block["arms"], key=lambda r: r["step_ms"]):
            t = block["time_to_target_s"].get(r["arm"])
            mb = None if r["bytes_per_step"] is None else r["bytes_per_step"] / 1e6
            lines.append(f"| {r['arm']} | {r['sync_every']} | {r['step_ms'] / 1e3:.3f} | {r['compute_ms'] / 1e3:.3f} "
                         f"| {_fmt(r['utilization'], '{:.1%}')} "
                         f"| {_fmt(mb, '{:.3f}')} | {_fmt(None if r['predicted_ms'] is None else r['predicted_ms'] / 1e3, '{:.3f}')} "
                         f"| {_fmt(r['error'], '{:+.1%}')} | {'not reached' if t is None and r['arm'] in block['time_to_target_s'] else _fmt(None if t is None else t / 60, '{:.1f} min')} |")
    if result.get("validations"):
        lines += ["", f"end to end on a shaped link against the composition (within {compose.VALIDATION_GOAL:.0%})", "",
                  "| arm | link | steps | bracket: runs × steps timed | step s (bracket) | composed s | measured s | error |",
                  "|---|---|---|---|---|---|---|---|"]
        for v in result["validations"]:
            bracket = f"{v['bracket_runs']} × {_fmt(v.get('bracket_steps'), '{}')}"
            lines.append(f"| {v['arm']} | {v['link']} | {v['at_step']} | {bracket} | {v['step_ms'] / 1e3:.3f} "
                         f"| {_fmt(v['composed_s'], '{:.1f}')} "
                         f"| {_fmt(v['measured_s'], '{:.1f}')} | {_fmt(v['rel_error'], '{:+.1%}')} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[float, float]]] = {}
    for link, block in result["links"].items():
        for r in block["arms"] if link != LOOPBACK else ():  # the plot's axis is the link's rate
            if r["arm"] != compose.COMPUTE_ARM and r["utilization"] is not None:
                family = r["arm"].rsplit("-h", 1)[0] if r["sync_every"] > 1 else r["arm"]
                label = f"{family} (H {r['sync_every']})" if r["sync_every"] > 1 else family
                series.setdefault(family, []).append((parse_rate(link) / 1e6, r["utilization"], label))
    fig, ax = plt.subplots(figsize=(8, 5))
    for family, pts in sorted(series.items()):
        pts.sort()
        best: dict[float, tuple] = {}
        for x, u, label in pts:  # the family's best H on each link
            if x not in best or u > best[x][1]:
                best[x] = (x, u, label)
        xs, us = [best[x][0] for x in sorted(best)], [best[x][1] for x in sorted(best)]
        ax.plot(xs, us, marker="o", label=family)
    ax.set_xscale("log")
    rates = sorted({x for pts in series.values() for x, _, _ in pts})
    ax.set_xticks(rates, [f"{r:g}" for r in rates])
    ax.minorticks_off()
    ax.set_xlabel("link rate per worker (Mbit/s), emulated, 2 workers")
    ax.set_ylabel("compute utilization (the run's compute step / its step)")
    ax.set_ylim(0, 1.05)
    ax.axhline(0.95, color="grey", lw=0.8, ls="--")
    ax.set_title("GPT on Shakespeare, p = 2: utilization against bandwidth (each DiLoCo family at its best H)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _pairs(values: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """``A=B`` options as a dict, and the values that are not of that form."""
    return dict(v.split("=", 1) for v in values if "=" in v), [v for v in values if "=" not in v]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipesgd_lab.bench.period_h", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timing", type=Path, default=Path("outputs/period-h/timing.json"))
    p.add_argument("--records", type=Path, default=Path("results/period-h/runs"))
    p.add_argument("--json", type=Path, default=Path("results/period-h/study.json"))
    p.add_argument("--plot", type=Path, default=Path("docs/img/period-h-utilization.png"))
    p.add_argument("--stand-in", action="append", default=[], metavar="ARM=CURVE",
                   help="price ARM's step on CURVE's loss curve (an arm timed without a curve of its own)")
    p.add_argument("--timed-as", action="append", default=[], metavar="CURVE=ARM",
                   help="price CURVE's loss curve at ARM's step times (an arm with ARM's exchange, not timed "
                        "under its own name)")
    p.add_argument("--latency", default="100us", help="α the model is given (default 100us)")
    p.add_argument("--ranks-per-replica", type=int, default=1, metavar="K",
                   help="the study's ranks per replica (the tool's --ranks-per-replica; default 1): only records "
                        "and timing rows of that shape are read (its timing file: timing-<M>x<K>.json). The "
                        "model's prediction column prices one rank per replica")
    p.add_argument("--probe", type=Path, default=None,
                   help="a folder of pipesgd_lab.bench.allreduce records (ring and native on each link): the "
                        "model prices each arm at the rate its allreduce measured there")
    a = p.parse_args(argv)
    stand_ins, bad = _pairs(a.stand_in)
    if bad := bad + [k for k in stand_ins if k not in ARMS]:
        p.error(f"argument --stand-in: {bad}: ARM=CURVE, ARM one of the study's arms")
    timed_as, bad = _pairs(a.timed_as)
    if bad := bad + [n for pair in timed_as.items() for n in pair if n not in ARMS]:
        p.error(f"argument --timed-as: {bad}: CURVE=ARM, both of the study's arms")
    if not a.timing.exists():
        p.error(f"argument --timing: {a.timing} does not exist (the tool's --phase timing writes it)")
    timing = json.loads(a.timing.read_text())
    other = sorted({r.get("ranks_per_replica", 1) for r in timing} - {a.ranks_per_replica})
    if other:
        p.error(f"argument --timing: {a.timing} has rows at {other} rank(s) per replica, not "
                f"--ranks-per-replica {a.ranks_per_replica}: one study, one shape")
    latency = parse_latency(a.latency)
    try:
        probe = load_probe(a.probe) if a.probe is not None else []
        probe_links(probe, latency)
    except (FileNotFoundError, ValueError) as e:
        p.error(f"argument --probe: {e}")
    untimed = sorted(arm for arm in timed_as.values() if not any(r["arm"] == arm for r in timing))
    if untimed:
        p.error(f"argument --timed-as: {untimed} has no step times in {a.timing}")
    result = study(timing, load_curves(a.records, a.ranks_per_replica), stand_ins, latency,
                   validations(a.records, a.ranks_per_replica), probe, timed_as)
    write_json_atomic(a.json, result)
    if str(a.plot) not in ("", "."):
        plot(result, a.plot)
    print(tables(result))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main())
