# Each target sets up everything it needs on a fresh machine: the venv, torch 2.13.0 (whichever
# build pip finds for it: see the README to choose the CPU one), the package with its test and
# dev extras, and tinker-cookbook without its dependencies (the test extra names what it imports).
# Re-running skips what is already installed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: help venv test test-all demo lint format protos bench clean

help:
	@echo "make demo       train a tiny model end to end, offline (trainwire demo)"
	@echo "make test       the fast tests (not marked slow), a few minutes"
	@echo "make test-all   the whole suite, slow crash and chaos tests included (what CI runs)"
	@echo "make bench      the CPU benchmarks, quick variants (docs/BENCHMARKS.md has the full runs)"
	@echo "make lint       ruff check and ruff format --check; make format fixes what it can"
	@echo "make protos     regenerate the wire code from protos/"
	@echo "make venv       only set up .venv (every target above does it first)"
	@echo "make clean      remove .venv and build leftovers"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test,dev]'
	$(BIN)/python -m pip install --quiet --no-deps 'tinker-cookbook==0.6.1'
	touch $(STAMP)

venv: $(STAMP)

# The suite runs on two pytest-xdist workers, one per core of a small machine: torch takes one
# thread in each (tests/conftest.py), and much of a test's time is spent waiting on the servers,
# processes and fsyncs it starts. A module's tests stay on one worker, in their order, so its
# module-scoped fixtures (servers, workspaces, references) are built once (--dist loadscope;
# modules with more tests go first). `make test-all WORKERS=0` runs it in one process;
# WORKERS=auto, one worker per core.
WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadscope

# The fast suite: everything but the tests marked slow (SIGKILL chaos, crash restarts, dispatch).
test: $(STAMP)
	$(PYTEST) -m "not slow"

# The whole suite, slow tests included: what CI runs.
test-all: $(STAMP)
	$(PYTEST)

demo: $(STAMP)
	$(BIN)/trainwire demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

protos: $(STAMP)
	$(BIN)/python tools/generate_protos.py

# The CPU benchmarks in their quick form, each printing its side-by-side ratios; the full runs,
# the GPU ones (bench/gpu.sh) and what they measured are in docs/BENCHMARKS.md.
bench: $(STAMP)
	$(BIN)/python bench/plan.py --examples 100000
	$(BIN)/python bench/engine.py --quick
	$(BIN)/python bench/service.py --quick
	$(BIN)/python bench/controller.py --quick

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
