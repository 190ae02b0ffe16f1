# Setup installs the CPU build of torch first: a bare `torch` requirement on a machine without it
# pulls a multi-GB CUDA build. Override TORCH for a GPU machine, e.g. `make setup TORCH=torch`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
DATA ?= ../shared/data
# Options for the benchmark suite, e.g. BENCH="--quick" or BENCH="--only 'resnet20/p2/*'".
BENCH ?=

.PHONY: setup datasets run test bench clean

setup: $(VENV)/.installed datasets

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,plot]"
	touch $@

# Fashion-MNIST for tests/unit/test_data.py is Debian's dataset-fashion-mnist (30 MB): installed when this
# runs as root with apt-get, quietly skipped otherwise (the test then skips, except under CI=true).
datasets:
	@if [ ! -d /usr/share/datasets/fashion-mnist ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist) \
	    >/dev/null 2>&1 || echo "note: dataset-fashion-mnist not installed; its test will skip"; fi

run: setup
	$(PY) -m pipesgd.train +experiment=resnet_cifar data.root=$(DATA) trainer.epochs=1

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) -m pipesgd.bench $(BENCH) data.root=$(DATA)

clean:
	rm -rf outputs multirun .pytest_cache
