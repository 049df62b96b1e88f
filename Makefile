# Each target sets up everything it needs on a fresh machine: the venv, torch 2.13.0 (whichever
# build pip finds for it: see the README to choose the CPU one), the package with its test and
# dev extras, and tinker-cookbook without its dependencies (the test extra names what it imports).
# Re-running skips what is already installed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test test-all demo lint format protos bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test,dev]'
	$(BIN)/python -m pip install --quiet --no-deps 'tinker-cookbook==0.6.1'
	touch $(STAMP)

venv: $(STAMP)

# The fast suite: everything but the tests marked slow (SIGKILL chaos, crash restarts, dispatch).
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

# The whole suite, slow tests included: what CI runs.
test-all: $(STAMP)
	$(BIN)/python -m pytest -q

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

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
