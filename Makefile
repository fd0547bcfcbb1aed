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

# Until the service lands: synthesize a short text on the embedded default model.
start: $(STAMP)
	$(BIN)/clonecast generate --text "Hello from clonecast." --out out/hello.codes.json

test: $(STAMP)
	$(BIN)/ruff check engine kernels service tests benchmarks
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check engine kernels service tests benchmarks
	$(BIN)/ruff format --check engine kernels service tests benchmarks
