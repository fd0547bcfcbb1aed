# One place for set-up and checks. `make start` and `make test` are the README's two commands.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

NODE_DEPS := web/node_modules/.installed
# Commands the tests need and the Debian packages that provide them (command:package):
# Node.js for the JavaScript SDK's tests, Chromium for the browser tests, HAProxy for the
# balancer test (tests/deploy), PostgreSQL for the shared voice store's (tests/postgres_server.py)
SYSTEM_COMMANDS := node:nodejs npm:npm chromium:chromium prometheus:prometheus promtool:prometheus haproxy:haproxy pg_ctl:postgresql

.PHONY: setup start test lint gpu-check system-deps

$(STAMP): pyproject.toml clients/python/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e clients/python -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# The service on the embedded default model: http://127.0.0.1:8737, ws://127.0.0.1:8737/v1/stream
start: $(STAMP)
	$(BIN)/clonecast serve $(if $(PORT),--port $(PORT))

# Installs the Debian packages of missing commands when run as root; otherwise says the one
# command to run. (A command from elsewhere, e.g. a newer Node.js, is used as it is; /usr/sbin,
# where haproxy lives, is searched also when a user's PATH lacks it, and so is each
# /usr/lib/postgresql/VERSION/bin, where Debian keeps pg_ctl off every PATH.)
system-deps:
	@PATH="$$PATH:/usr/sbin:/sbin"; for dir in /usr/lib/postgresql/*/bin; do PATH="$$PATH:$$dir"; done; \
	missing=""; for pair in $(SYSTEM_COMMANDS); do \
	  command -v $${pair%%:*} >/dev/null || missing="$$missing $${pair#*:}"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	else \
	  echo "the tests need Debian packages:$$missing; run: sudo apt-get install -y --no-install-recommends$$missing"; exit 1; \
	fi

$(NODE_DEPS): web/package.json web/package-lock.json
	cd web && npm ci --no-audit --no-fund --loglevel=error
	touch $(NODE_DEPS)

test: system-deps $(STAMP) $(NODE_DEPS)
	$(BIN)/ruff check engine kernels service clients grafana tests benchmarks
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check engine kernels service clients grafana tests benchmarks
	$(BIN)/ruff format --check engine kernels service clients grafana tests benchmarks
