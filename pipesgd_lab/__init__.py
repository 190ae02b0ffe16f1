"""The tools that study and emulate the training library: the benchmark suite and its studies
(bench/), emulated clusters (emulate/), reports (report/) and the convergence table (study.py).
They import the library; the library never imports them (tests/distributed/test_layout.py)."""
