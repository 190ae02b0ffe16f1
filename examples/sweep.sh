#!/usr/bin/env bash
# A sweep and its report, in two commands:
#
#   examples/sweep.sh OUT_DIR [hydra overrides...]
#
# runs `python -m pipesgd.train -m OVERRIDES` (a comma list sweeps a key: trainer.mode=sync,pipe)
# with every job in OUT_DIR/<job number>, then `python -m pipesgd_lab.report sweep OUT_DIR`, which
# prints the table and writes sweep.md, sweep.csv, sweep_accuracy.png and sweep_breakdown.png.
# Without overrides: the MNIST MLP on 2 workers, sync vs pipe, without and with int8 compression.
# Compare the jobs' curves and hyper-parameters with `tensorboard --logdir OUT_DIR` (HParams tab).
# PYTHON picks the interpreter (default python3).
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 OUT_DIR [hydra overrides...]" >&2
  exit 2
fi
out=$1
shift
if [ $# -eq 0 ]; then
  set -- +experiment=mnist_mlp trainer.mode=sync,pipe compressor=none,int8
fi
py=${PYTHON:-python3}
# Hydra's own launcher lines go to stdout; keep stdout for the report's table.
"$py" -m pipesgd.train -m "hydra.sweep.dir=$out" "$@" >&2
"$py" -m pipesgd_lab.report sweep "$out"
