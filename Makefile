# `make train` and `make test` create .venv on first use, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Pinned so that machines with a local CPU wheel (like ours) take it instead of a multi-GB CUDA
# download; override with TORCH_SPEC='torch' (or a CUDA index) on GPU machines.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install train test test-fast lint clean-cache

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/python train.py $(ARGS)

# One test worker per core (pytest-xdist); the files whose tests share a trained run stay on one
# worker (--dist loadgroup). PYTEST_ARGS='-n 0' runs in one process.
PYTEST := $(BIN)/python -m pytest -q -n auto --dist loadgroup

test: $(STAMP)
	$(PYTEST) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean-cache:
	rm -rf .cache/tinyformer
