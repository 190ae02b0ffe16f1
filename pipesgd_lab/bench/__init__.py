"""The benchmark suite (``make bench`` = ``python -m pipesgd_lab.bench``): iteration time of every mode,
allreduce bus bandwidth, and the timing model's prediction next to each measurement.

grid.py    which cells exist (names, subsets)
runner.py  how a cell runs (calibrate once per condition, repeats, warm-up skip, CPU accounting)
allreduce.py  the bus-bandwidth worker (``python -m pipesgd_lab.bench.allreduce``)
render.py  results/benchmarks/benchmarks.json -> the generated tables of docs/benchmarks.md
"""
