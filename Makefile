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

# Until the service lands: speak a short text into out/hello.wav on the embedded default model.
start: $(STAMP)
	$(BIN)/clonecast synthesize --text "Hello from clonecast." --max-rows 200 --out out/hello.wav

test: $(STAMP)
	$(BIN)/ruff check engine kernels service tests benchmarks
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check engine kernels service tests benchmarks
	$(BIN)/ruff format --check engine kernels service tests benchmarks
