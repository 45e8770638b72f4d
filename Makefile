# duetime — the two commands: `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv install services test test-fast lint typecheck demo bench chaos clean stop-services \
	dashboard-shots

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev,bench]'
	touch $(STAMP)

venv install: $(STAMP)

services:
	bash scripts/services.sh

lint: $(STAMP)
	$(BIN)/ruff check scheduler workers duetime tests bench scripts
	$(BIN)/ruff format --check scheduler workers duetime tests bench scripts

typecheck: $(STAMP)
	$(BIN)/mypy

test: $(STAMP) services lint typecheck
	$(BIN)/pytest -q -ra --durations=15 $(PYTEST_ARGS)

test-fast: $(STAMP) services
	$(BIN)/pytest -q -x -m 'not chaos and not slow' $(PYTEST_ARGS)

demo: $(STAMP) services
	$(BIN)/duetime demo $(DEMO_ARGS)

# Seeds a demo database, serves the dashboard and screenshots every page into
# docs/dashboard/ (Playwright driving Debian's chromium).
dashboard-shots: $(STAMP) services
	$(BIN)/python scripts/dashboard_shots.py $(SHOTS_ARGS)

bench: $(STAMP) services
	$(BIN)/duetime bench all $(BENCH_ARGS)

chaos: $(STAMP) services
	DUETIME_TEST_SOAK=1 $(BIN)/pytest -q -s -m chaos tests/chaos $(PYTEST_ARGS)

stop-services:
	-@[ -f .run/etcd.pid ] && kill $$(cat .run/etcd.pid) 2>/dev/null; rm -f .run/etcd.pid

clean: stop-services
	rm -rf .run .pytest_cache .mypy_cache .ruff_cache
