# One place for set-up and checks. `make start` and `make test` are the README's two commands.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup start test lint gpu-check

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# The service on the embedded default model: http://127.0.0.1:8737, ws://127.0.0.1:8737/v1/stream
start: $(STAMP)
	$(BIN)/clonecast serve

test: $(STAMP)
	$(BIN)/ruff check engine kernels service tests benchmarks
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check engine kernels service tests benchmarks
	$(BIN)/ruff format --check engine kernels service tests benchmarks
