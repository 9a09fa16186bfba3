# Kestrel One. Two commands matter: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEPS := $(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
# What the service needs, and on top of it what the tests and linters need.
RUN_STAMP := $(VENV)/.installed-run-$(DEPS)
STAMP := $(VENV)/.installed-test-$(DEPS)

.PHONY: run test install install-run lint check-migrations docker-ready sandboxes images browser bench clean

$(RUN_STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e .
	rm -f $(VENV)/.installed-run-* && touch $@

$(STAMP): $(RUN_STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	rm -f $(VENV)/.installed-test-* && touch $@

install-run: $(RUN_STAMP)

install: $(STAMP)

## The single-host service on 127.0.0.1:8000 (PORT to change): SQLite under ./var, its own
## broker (redis-server on a socket in ./var), and a sandbox (Docker with the tool image,
## else bubblewrap), set up when missing and possible. Prints how to sign in on the first run.
run: install-run
	@bash deploy/scripts/ensure-single-host.sh
	KESTREL_MODE=$${KESTREL_MODE:-single-host} $(BIN)/python manage.py serve --port $${PORT:-8000}

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

check-migrations: install
	DJANGO_SETTINGS_MODULE=kestrel_one.settings_test $(BIN)/python manage.py makemigrations --check --dry-run

## A Docker engine and the locally built tool image and managed MCP server images (no
## registry needed; both scripts skip an image that is already current).
docker-ready:
	bash deploy/scripts/ensure-docker.sh

images: docker-ready
	bash deploy/images/tool-runtime/build.sh
	bash deploy/images/mcp-servers/build.sh

## Bubblewrap, the other sandbox backend (single-host without Docker); the tests need both.
sandboxes: images
	bash deploy/scripts/ensure-bubblewrap.sh

## Debian's chromium and the npm packages from package-lock.json: axe-core for the console's
## browser tests, the MCP conformance suite and the MCP Inspector CLI for tests/mcp_endpoint.
browser:
	bash deploy/scripts/ensure-browser.sh

## Everything, against real PostgreSQL, Redis, Docker and a browser. Fails (never skips) when
## one is missing.
test: install lint check-migrations sandboxes browser
	$(BIN)/pytest

bench: install images
	$(BIN)/python bench/run.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache node_modules
