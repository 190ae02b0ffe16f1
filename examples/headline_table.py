"""Reproduce the headline table: synchronous allreduce SGD, DDP, Pipe-SGD (width 2) and Pipe-SGD
with fp16 and int8 compression, on the same model, data and workers.

    python examples/headline_table.py                            # ResNet-20 / CIFAR-10, 2 workers, 1 epoch
    python examples/headline_table.py --epochs 30                # the full schedule of resnet_cifar
    python examples/headline_table.py --quick                    # MNIST MLP, 4 steps per job (CI)
    python examples/headline_table.py -- data.root=../shared/data dist.nproc=4   # any override

It runs two multiruns through examples/sweep.sh (Hydra sweeps take products of values, and these
five rows are not one product), then builds the sweep report over both and writes the compact
table to OUT/headline.md and stdout. Iteration times are medians over each job's steps on this
machine: say which machine and link when you quote them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

from pipesgd_lab.report import sweep_report  # noqa: E402

GROUPS = {  # sub-directory -> the sweep's own overrides
    "baselines": ["trainer.mode=sync,ddp,pipe", "compressor=none"],
    "compressed": ["trainer.mode=pipe", "compressor=fp16,int8"],
}
NAMES = {("sync", "none"): "sync allreduce SGD", ("ddp", "none"): "PyTorch DDP",
         ("pipe", "none"): "Pipe-SGD (width 2)", ("pipe", "fp16"): "Pipe-SGD + fp16",
         ("pipe", "int8"): "Pipe-SGD + int8"}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="output directory (default multirun/headline-TIME)")
    p.add_argument("--experiment", default="resnet_cifar")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="MNIST MLP, 4 steps per job: checks the pipeline only")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every job (after --)")
    return p.parse_args()


def headline(table: list[dict]) -> str:
    lines = ["| configuration | p | test accuracy | iteration (ms) | speedup vs sync | wall (s) |",
             "| --- | --- | --- | --- | --- | --- |"]
    order = list(NAMES)
    for r in sorted(table, key=lambda r: order.index((r["mode"], r["compressor"]))
                    if (r["mode"], r["compressor"]) in order else len(order)):
        speedup = f"{r['speedup_vs_sync']:.2f}x" if r["speedup_vs_sync"] else "n/a"
        lines.append(f"| {NAMES.get((r['mode'], r['compressor']), r['job'])} | {r['p']} | "
                     f"{100 * r['test_accuracy']:.2f}% | {r['iter_ms']:.1f} | {speedup} | {r['wall_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse()
    out = (args.out or Path("multirun") / time.strftime("headline-%Y-%m-%d_%H-%M-%S")).resolve()
    if args.quick:
        common = ["+experiment=mnist_mlp", "trainer.max_steps=4", "trainer.log_every=2"]
    else:
        common = [f"+experiment={args.experiment}", f"trainer.epochs={args.epochs}"]
    env = {**os.environ, "PYTHON": sys.executable}
    for name, grid in GROUPS.items():
        r = subprocess.run(["bash", str(HERE / "sweep.sh"), str(out / name), *common, *grid, *args.overrides],
                           env=env, stdout=subprocess.DEVNULL)
        if r.returncode != 0:
            print(f"the {name} sweep failed (exit {r.returncode}); its jobs are in {out / name}", file=sys.stderr)
            return r.returncode
    report = sweep_report(out)
    table = headline(report.table)
    (out / "headline.md").write_text(table)
    sys.stdout.write(table)
    print(f"full report: {out / 'sweep.md'}; plots: {out}/sweep_*.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
