# Two entry points on a fresh machine with only Python 3.11: `make train` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup train test test-slow test-all lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Pin the CPU build of torch first: a bare range would pull a multi-GB CUDA build on these machines.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,hf]'
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/dynmo-train $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check dynmo_lightning tests examples

# Two pytest workers (one per core of a small CI machine); a test file stays on one worker, so the processes a module
# launches once for all its tests are launched once. JOBS=0 runs in one process. The slowest tests are listed.
JOBS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -n $(JOBS) --dist loadfile --durations=10

# The fast lane, after every change: ruff and every test but the multi-process end-to-end runs.
test: $(STAMP) lint
	$(PYTEST) -m "not slow" $(ARGS)

# The slow lane: the multi-process end-to-end runs (marked `slow`).
test-slow: $(STAMP)
	$(PYTEST) -m slow $(ARGS)

# Everything, as CI runs it: the fast lane, then the slow one.
test-all: test test-slow

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache .ruff_cache
