# `make train` and `make test` create .venv on first use, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Pinned so that machines with a local CPU wheel (like ours) take it instead of a multi-GB CUDA
# download; override with TORCH_SPEC='torch' (or a CUDA index) on GPU machines.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: install train test test-fast lint clean-cache

install: $(STAMP)

# What a run needs, and no more: where transformers is installed every run imports it
# (torchmetrics, which Lightning imports, does), about 0.8 s of each start on a 2-core CPU; so
# `make train` leaves the dev extra, which has it for the tests, to `make test`.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e .
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(BIN)/pip install -q -e ".[dev]"
	touch $(DEV_STAMP)

train: $(STAMP)
	$(BIN)/python train.py $(ARGS)

# One test worker per core (pytest-xdist); the files whose tests share a trained run stay on one
# worker (--dist loadgroup). PYTEST_ARGS='-n 0' runs in one process.
PYTEST := $(BIN)/python -m pytest -q -n auto --dist loadgroup

test: $(DEV_STAMP)
	$(PYTEST) $(PYTEST_ARGS)

test-fast: $(DEV_STAMP)
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

lint: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean-cache:
	rm -rf .cache/tinyformer
