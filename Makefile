# Setup installs the CPU build of torch first: a bare `torch` requirement on a machine without it
# pulls a multi-GB CUDA build. Override TORCH for a GPU machine, e.g. `make setup TORCH=torch`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
DATA ?= ../shared/data
# Options for the benchmark suite, e.g. BENCH="--quick" or BENCH="--only 'resnet20/p2/*'".
BENCH ?=

.PHONY: setup run test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,plot]"
	touch $@

run: setup
	$(PY) -m pipesgd.train +experiment=resnet_cifar data.root=$(DATA) trainer.epochs=1

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) -m pipesgd.bench $(BENCH) data.root=$(DATA)

clean:
	rm -rf outputs multirun .pytest_cache
