# duetime — the two commands: `make demo` and `make test`; `make help` lists the rest.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
#: What ruff reads (mypy reads the packages listed in pyproject.toml).
SRC := scheduler workers duetime demo tests bench scripts

.DEFAULT_GOAL := help
.PHONY: help venv install venv-django6 services test-postgres check test test-fast lint typecheck demo bench chaos clean \
	stop-services dashboard-shots

help: ## list the targets, one line each
	@awk 'BEGIN {FS = ":[^#]*## "} /^[a-z][a-z0-9 -]*:.*## / {printf "  %-16s %s\n", $$1, $$2}' \
		$(MAKEFILE_LIST)

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev,bench]'
	touch $(STAMP)

venv install: $(STAMP) ## create .venv and install duetime editable with dev and bench extras

# A second venv on Python >= 3.12 with Django 6, for the Django Tasks backend's tests
# (tests/integration/test_django_tasks.py); `make test` makes it (about 30 s, once).
venv-django6: ## create .venv-django6 (Python >= 3.12, Django 6) for the Django Tasks tests
	bash scripts/venv_django6.sh

services: ## start whichever of PostgreSQL, RabbitMQ and etcd is not answering
	bash scripts/services.sh

lint: $(STAMP) ## ruff: lint and formatting
	$(BIN)/ruff check $(SRC)
	$(BIN)/ruff format --check $(SRC)

typecheck: $(STAMP) ## mypy on the packages
	$(BIN)/mypy

# The quick gate before a commit: no PostgreSQL, RabbitMQ or etcd needed (unit tests
# only); about 30 s on the 2-core development machine.
check: $(STAMP) lint typecheck ## lint, typecheck and the unit tests: no services needed
	$(BIN)/pytest -q tests/unit $(PYTEST_ARGS)

# The suite runs against a server of its own (scripts/test_postgres.sh: the shared one's
# settings, room for 300 connections) unless DUETIME_TEST_DATABASE_URL names one: all but
# the chaos tests in TEST_PROCESSES pytest processes (each with its own databases, vhost
# and etcd prefixes), then the chaos tests alone, as their faults and timings want.
TEST_PROCESSES ?= 2
TEST_DB = $${DUETIME_TEST_DATABASE_URL:-$$(bash scripts/test_postgres.sh url)}

test-postgres: ## start the test suite's own PostgreSQL (idempotent; not when DUETIME_TEST_DATABASE_URL is set)
	@[ -n "$${DUETIME_TEST_DATABASE_URL:-}" ] || bash scripts/test_postgres.sh start

test: $(STAMP) venv-django6 services test-postgres lint typecheck ## everything: lint, typecheck and every test suite
	DUETIME_TEST_DATABASE_URL=$(TEST_DB) $(BIN)/pytest -q -ra -n $(TEST_PROCESSES) --dist loadfile \
	  -m 'not chaos' --durations=15 $(PYTEST_ARGS)
	DUETIME_TEST_DATABASE_URL=$(TEST_DB) $(BIN)/pytest -q -ra -m chaos --durations=10 \
	  $(PYTEST_ARGS) || [ $$? -eq 5 ]  # 5: PYTEST_ARGS selected no chaos test

test-fast: $(STAMP) venv-django6 services test-postgres ## the tests without the chaos and slow ones, stop at the first failure
	DUETIME_TEST_DATABASE_URL=$(TEST_DB) $(BIN)/pytest -q -x -n $(TEST_PROCESSES) \
	  -m 'not chaos and not slow' $(PYTEST_ARGS)

demo: $(STAMP) services ## a local cluster live: jobs, cron, the leader killed, a summary
	$(BIN)/duetime demo $(DEMO_ARGS)

# Seeds a demo database, serves the dashboard and screenshots every page into
# docs/dashboard/ (Playwright driving Debian's chromium).
dashboard-shots: $(STAMP) services ## screenshot every dashboard page into docs/dashboard/
	$(BIN)/python scripts/dashboard_shots.py $(SHOTS_ARGS)

bench: $(STAMP) services ## every benchmark (docs/benchmarks.md); BENCH_ARGS passes options
	$(BIN)/duetime bench all $(BENCH_ARGS)

chaos: $(STAMP) services test-postgres ## the fault-injection suite (real processes, signals, a fault proxy)
	DUETIME_TEST_DATABASE_URL=$(TEST_DB) DUETIME_TEST_SOAK=1 $(BIN)/pytest -q -s -m chaos tests/chaos $(PYTEST_ARGS)

stop-services: ## stop the etcd that `make services` started and the test suite's PostgreSQL
	-@[ -f .run/etcd.pid ] && kill $$(cat .run/etcd.pid) 2>/dev/null; rm -f .run/etcd.pid
	-@bash scripts/test_postgres.sh stop

clean: stop-services ## stop-services, then remove caches and .run/
	rm -rf .run .pytest_cache .mypy_cache .ruff_cache
