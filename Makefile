# Entry points for developers and CI. `make test` is the full gate (README's test
# command): node dependencies, venv, static checks, unit and integration tests.
# The integration suite needs root, and drives real containerd/runc/CRIU.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Extra pytest arguments, e.g. `make integration PYTEST_ARGS='-k cri -x'`.
PYTEST_ARGS ?=

.PHONY: setup venv check unit integration test demo

setup:
	bash scripts/setup-node-deps.sh
	$(MAKE) --no-print-directory venv

# Debian's python3 cannot create a venv without python3-venv (ensurepip), which the
# node setup does not install.
venv:
	@if [[ ! -x $(BIN)/python ]]; then \
	  if ! $(PYTHON) -m venv $(VENV) 2>/dev/null; then \
	    rm -rf $(VENV); \
	    apt-get update -qq; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null; \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi
	$(BIN)/python -m pip install -q -e '.[test]'

check:
	$(BIN)/python scripts/gen_protos.py --check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/mypy tests/integration

unit:
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

integration:
	$(BIN)/pytest tests/integration $(PYTEST_ARGS)

# Sequential on purpose, even under `make -j`: each step needs the previous one.
test:
	$(MAKE) --no-print-directory setup
	$(MAKE) --no-print-directory check
	$(MAKE) --no-print-directory unit
	$(MAKE) --no-print-directory integration

# README's first command: set this machine up as a node, then show the whole story.
demo: setup
	$(BIN)/python scripts/demo.py
