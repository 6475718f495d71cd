# Entry points for developers and CI. `make test` is the full gate (README's test
# command): node dependencies, venv, static checks, unit and integration tests.
# The integration suite needs root, and drives real containerd/runc/CRIU; the unit
# suite needs neither.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Extra pytest arguments, e.g. `make integration PYTEST_ARGS='-k cri -x'`.
PYTEST_ARGS ?=

.PHONY: setup venv check unit integration test demo vm-test

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
	$(BIN)/python -m pip install -q -e '.[node,test]'
	# containerd execs the shim on every container's critical path: replace pip's
	# console-script wrapper with the fast launcher (no site, no re).
	$(BIN)/python -m cedana_shim.launcher $(BIN)/containerd-shim-cedana-v2
	$(BIN)/python -m cedana_shim.launcher $(BIN)/cedana-slurm-task --module cedana_shim.cli.slurm_task

check:
	$(BIN)/python scripts/gen_protos.py --check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/mypy tests/integration
	$(BIN)/mypy tests/vm
	$(BIN)/mypy bench
	$(BIN)/lint-imports --no-cache

# Runs as any user: tests that need root live in tests/privileged.
# Root-free; one worker per core (the task tests wait on real processes).
# EXAMPLES=quick (the inner loop): property tests draw a fifth of their examples;
# `make test` draws them all (tests/support/examples.py).
EXAMPLES ?= quick
# The unit tests make, fsync and remove tens of thousands of small files: on a tmpfs,
# where /dev/shm has 4 GiB free (a container's is often 64 MiB), ~6 s less of ~53.
UNIT_TMPDIR ?= $(shell avail=$$(df --output=avail -k /dev/shm 2>/dev/null | tail -n 1); \
  [[ $$avail =~ ^[0-9]+$$ ]] && ((avail > 4194304)) && echo /dev/shm)
unit:
	$(if $(UNIT_TMPDIR),TMPDIR=$(UNIT_TMPDIR)) CEDANA_TEST_EXAMPLES=$(EXAMPLES) \
	  $(BIN)/pytest tests/unit -n auto $(PYTEST_ARGS)

# Root: tests/privileged (real mounts, cgroups, namespaces, runc and CRIU driven
# directly) and tests/integration (containerd).
integration:
	$(BIN)/pytest tests/privileged tests/integration $(PYTEST_ARGS)

# Sequential on purpose, even under `make -j`: each step needs the previous one.
test:
	$(MAKE) --no-print-directory setup
	$(MAKE) --no-print-directory check
	$(MAKE) --no-print-directory unit EXAMPLES=all
	$(MAKE) --no-print-directory integration

# The VM tier (tests/vm, README "Supported nodes"): a guest with cgroup v2 only, systemd
# and a kernel that tracks dirty pages, booted once under qemu with this host's / as its
# root; the suite runs inside it. Root, after `make setup`; the kernel and initramfs are
# built once and cached (/opt/cedana-deps/vm). VM_TIMEOUT bounds the run, boot included.
VM_TIMEOUT ?= 1500
vm-test:
	python3 tests/vm/machine/vm.py --timeout $(VM_TIMEOUT) -- \
	  $(BIN)/python -m pytest tests/vm -v -p no:cacheprovider --durations=10 $(PYTEST_ARGS)

# README's first command: set this machine up as a node, then show the whole story.
demo: setup
	$(BIN)/python scripts/demo.py

# Benchmarks, cedana vs containerd's runc shim / plain runc side by side (root; each
# starts its own private containerd). Results land in bench/results/*.json; see
# bench/README.md. Extra arguments for every script: BENCH_ARGS='--containerd 2.1'.
BENCH_ARGS ?=
.PHONY: bench
bench:
	@mkdir -p bench/results
	$(BIN)/python bench/start_latency.py $(BENCH_ARGS) --out bench/results/start_latency.json
	$(BIN)/python bench/shim_memory.py $(BENCH_ARGS) --out bench/results/shim_memory.json
	$(BIN)/python bench/checkpoint_restore.py $(BENCH_ARGS) --out bench/results/checkpoint_restore.json
	$(BIN)/python bench/across_nodes.py $(BENCH_ARGS) --out bench/results/across_nodes.json
	$(BIN)/python bench/slurm_launch.py --out bench/results/slurm_launch.json
	$(BIN)/python bench/restore_scaling.py $(BENCH_ARGS) --out bench/results/restore_scaling.json
	$(BIN)/python bench/flatten.py --out bench/results/flatten.json
