"""Turn a multirun directory of the convergence study into a table and an accuracy-vs-epoch plot.

``python -m pipesgd_lab.study multirun/2026-11-22/03-30-00 [--target 0.9] [--plot acc.png]``

Reads every ``summary.json`` below the directory, labels each run by what it trained with (mode,
width, staleness rule, compressor and its error feedback, e.g. ``pipe+dga`` or ``pipe+int8-ef``),
groups runs by (dataset, model, label) and prints one Markdown row per group: final test accuracy
as mean ± half-range over seeds (and each seed's value), the gap to ``sync`` in percentage
points, median bytes per step and compression ratio, median iteration time, and, with
``--target``, the mean wall-clock seconds to the first evaluation at or above the target
(``-`` if a seed never reached it). Self-contained: only the standard library, plus matplotlib
for ``--plot``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from collections import defaultdict
from pathlib import Path

log = logging.getLogger("pipesgd_lab.study")

IN_RING = ("none", "fp16", "bf16", "int8")


def label(summary: dict) -> str:
    """What a run trained with, in the study's vocabulary."""
    cfg = summary.get("config", {})
    trainer = cfg.get("trainer", {})
    mode = summary["mode"]
    parts = [mode if summary.get("width", 1) in (1, 2) or mode != "pipe" else f"pipe(K={summary['width']})"]
    staleness = summary.get("staleness", trainer.get("staleness", "none"))
    if staleness != "none" and mode == "pipe":
        parts.append(staleness)
    comp = summary.get("compressor", "none")
    if comp != "none":
        ef = cfg.get("compressor", {}).get("error_feedback", False)
        if comp in IN_RING:
            parts.append(f"{comp}-ef" if ef else comp)
        else:
            parts.append(comp if ef else f"{comp}-noef")
    return "+".join(parts)


def _short(target: str | None) -> str:
    return (target or "?").rsplit(".", 1)[-1]


def load(root: Path) -> list[dict]:
    runs = []
    for path in sorted(root.rglob("summary.json")):
        s = json.loads(path.read_text())
        cfg = s.get("config", {})
        s["_label"] = label(s)
        s["_group"] = (_short(cfg.get("data", {}).get("_target_")), _short(cfg.get("model", {}).get("_target_")))
        s["_seed"] = cfg.get("seed")
        s["_path"] = str(path.parent)
        runs.append(s)
    return runs


def _mean_spread(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (max(xs) - min(xs)) / 2


def time_to(run: dict, target: float) -> float | None:
    """Wall seconds from the start of training to the first evaluation reaching ``target``."""
    for e in run.get("evals", []):
        if e["test_accuracy"] >= target:
            return e["elapsed_s"]
    return None


def rows(runs: list[dict], target: float | None = None) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in runs:
        groups[(*r["_group"], r["_label"])].append(r)
    sync = {key[:2]: _mean_spread([r["test_accuracy"] for r in rs])[0]
            for key, rs in groups.items() if key[2] == "sync"}
    out = []
    for (data, model, lab), rs in sorted(groups.items(), key=lambda kv: (kv[0][:2], _order(kv[0][2]))):
        rs = sorted(rs, key=lambda r: (r["_seed"] is None, r["_seed"]))
        accs = [r["test_accuracy"] for r in rs]
        mean, spread = _mean_spread(accs)
        row = {
            "data": data, "model": model, "variant": lab, "seeds": [r["_seed"] for r in rs],
            "epochs": sorted({r["epochs"] for r in rs}), "acc_mean": mean, "acc_spread": spread, "accs": accs,
            "gap_pp": 100 * (mean - sync[(data, model)]) if (data, model) in sync else None,
            "bytes_per_step": statistics.median(r["bytes_per_step"] for r in rs),
            "ratio": statistics.median(r["compression_ratio"] for r in rs),
            "iter_ms": statistics.median(r["median_iter_ms"] for r in rs if r["median_iter_ms"] is not None),
            "wall_s": statistics.fmean(r["wall_seconds"] for r in rs),
        }
        if target is not None:
            times = [time_to(r, target) for r in rs]
            row["time_to_target_s"] = None if None in times else statistics.fmean(times)
        out.append(row)
    return out


def _order(lab: str) -> tuple[int, str]:
    return (0 if lab == "sync" else 1 if lab == "pipe" else 2, lab)


def markdown(table: list[dict], target: float | None = None) -> str:
    head = ["data", "model", "variant", "seeds", "epochs", "test acc % (mean ± half-range)", "per seed",
            "gap to sync (pp)", "bytes/step", "ratio", "iter ms"]
    if target is not None:
        head.append(f"s to {100 * target:g} %")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        cells = [r["data"], r["model"], r["variant"], str(len(r["seeds"])), ",".join(map(str, r["epochs"])),
                 f"{100 * r['acc_mean']:.2f} ± {100 * r['acc_spread']:.2f}",
                 " / ".join(f"{100 * a:.2f}" for a in r["accs"]),
                 "-" if r["gap_pp"] is None else f"{r['gap_pp']:+.2f}",
                 f"{r['bytes_per_step']:,.0f}", f"{r['ratio']:.1f}", f"{r['iter_ms']:.1f}"]
        if target is not None:
            t = r.get("time_to_target_s")
            cells.append("-" if t is None else f"{t:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    """Test accuracy after each epoch: mean over seeds per variant, min-max band; one panel per
    (dataset, model)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = sorted({r["_group"] for r in runs})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        by_label: dict[str, list[dict]] = defaultdict(list)
        for r in runs:
            if r["_group"] == panel:
                by_label[r["_label"]].append(r)
        for lab in sorted(by_label, key=_order):
            curves = [{e["epoch"]: e["test_accuracy"] for e in r.get("evals", [])} for r in by_label[lab]]
            epochs = sorted(set.intersection(*(set(c) for c in curves)))
            ys = [[100 * c[e] for c in curves] for e in epochs]
            ax.plot(epochs, [statistics.fmean(y) for y in ys], marker="o", label=f"{lab} (n={len(curves)})")
            ax.fill_between(epochs, [min(y) for y in ys], [max(y) for y in ys], alpha=0.15)
        ax.set(title=" / ".join(panel), xlabel="epoch", ylabel="test accuracy (%)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipesgd_lab.study", description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path, help="a multirun directory (searched recursively for summary.json)")
    ap.add_argument("--target", type=float, default=None, help="accuracy in [0, 1] for time-to-accuracy")
    ap.add_argument("--plot", type=Path, default=None, help="write the accuracy-vs-epoch plot here (PNG)")
    ap.add_argument("--json", type=Path, default=None, help="also write the table as JSON here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.target is not None and not 0 < args.target <= 1:
        ap.error(f"--target={args.target} is invalid: an accuracy in (0, 1]")
    runs = load(args.root)
    if not runs:
        log.error("no summary.json below %s", args.root)
        return 2
    table = rows(runs, args.target)
    sys.stdout.write(markdown(table, args.target) + "\n")
    if args.json:
        args.json.write_text(json.dumps(table, indent=2))
    if args.plot:
        plot(runs, args.plot)
        log.info("plot: %s", args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
