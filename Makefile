# Two commands do all the set-up: `make demo` (run the main job) and `make test` (the quick tests; `make test-all`
# runs every test, as CI does, and `make lint` checks the style).
# Both create the virtual environment first when it is missing or pyproject.toml changed.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin

export FLWR_TELEMETRY_ENABLED = 0
export FLWR_DISABLE_UPDATE_CHECK = 1
export RAY_USAGE_STATS_ENABLED = 0
export RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO = 0

.PHONY: demo test test-all lint env clean docs-check

demo: $(VENV)/.installed
	$(BIN)/florist simulate --strategy fedavg --num-clients 20 --partition dirichlet:0.3 --rounds 30 --seed 1 --results-dir results/demo

# The quick tests: everything but those tests/conftest.py lists as slow (real processes, Ray, docker, the fuzzer).
test: $(VENV)/.installed
	$(BIN)/python -m pytest -m "not slow"

# Every test, the slow ones too.
test-all: $(VENV)/.installed
	$(BIN)/python -m pytest

# ruff, pinned in pyproject.toml's dev extra and configured there: formatting and lint rules.
lint: $(VENV)/.installed
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

# Every shell block of README.md and docs/ as written, the docs-check-only ones too (tests/test_docs.py;
# `make test-all` runs the others at reduced size). Hours: docs/comparing.md's first block alone is 24 runs,
# about 1.5 h on 2 cores by the seconds per round its table gives.
docs-check: $(VENV)/.installed
	FLORIST_DOCS_FULL=1 $(BIN)/python -m pytest -n 0 -s tests/test_docs.py

env: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), f"florist needs Python 3.11, $(PYTHON) is {sys.version.split()[0]}"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

clean:
	rm -rf $(VENV) results
