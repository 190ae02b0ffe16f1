# Setup installs the CPU build of torch first: a bare `torch` requirement on a machine without it
# pulls a multi-GB CUDA build. Override TORCH for a GPU machine, e.g. `make setup TORCH=torch`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
DATA ?= ../shared/data
# pytest workers for `make test` (pytest-xdist). Two: most of a test's wall time is one process
# importing torch or waiting on a peer, so a second test fills the idle core; the tests that build
# network namespaces run in one worker, one at a time (tests/conftest.py). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
# Options for the benchmark suite, e.g. BENCH="--quick" or BENCH="--only 'resnet20/p2/*'".
BENCH ?=

.PHONY: setup debs run test test-lib bench gpu-check clean

setup: $(VENV)/.installed debs

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,plot,live,trainers]"
	touch $@

# Debian packages that tests need, installed when this runs as root with apt-get and skipped
# otherwise with a note (their tests then skip with the reason, except under CI=true, where they fail):
#   dataset-fashion-mnist (30 MB)      tests/unit/test_data.py
#   slurm-wlm munge (SLURM 22.05)      the SLURM tier, tests/slurm (docs/multi-node.md, "SLURM")
DEBS ?= dataset-fashion-mnist slurm-wlm munge

debs:
	@missing=$$(for p in $(DEBS); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	missing=$$(echo $$missing); \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "note: not root with apt-get, so not installing $$missing; the tests that need them will skip"; exit 0; fi; \
	(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) >/dev/null 2>&1 \
	  || echo "note: apt-get install $$missing failed; the tests that need them will skip"

run: setup
	$(PY) -m pipesgd.train +experiment=resnet_cifar data.root=$(DATA) trainer.epochs=1

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS)

# The library's tests only: every tier but the lab's (tests/lab) and SLURM's, whose hosts are the
# lab's emulated ones (tests/README.md). tests/distributed/test_layout.py keeps the rest off the lab.
test-lib: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --ignore=tests/lab --ignore=tests/slurm

bench: setup
	$(PY) -m pipesgd_lab.bench $(BENCH) data.root=$(DATA)

# The whole GPU check in one command, at most 8 minutes on one GPU (docs/gpu.md, "The GPU check").
# It needs only a CUDA build of torch: the .venv's python when there is one (make setup TORCH=torch),
# else the machine's python3. Options, e.g. GPU_CHECK="--dry-run" or GPU_CHECK="--out DIR --only overlap".
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
GPU_CHECK ?=

gpu-check:
	$(GPU_PY) -m pipesgd_lab.gpu_check $(GPU_CHECK)

clean:
	rm -rf outputs multirun .pytest_cache
