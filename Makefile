# `make demo` and `make test` each set up .venv first (once). The CPU build of torch is pinned
# here so a fresh machine never downloads CUDA wheels; to keep a torch you already have, run with
# TORCH= VENV_FLAGS=--system-site-packages (see README). torchao, the reference of the low-bit
# Adam tests, and torchtitan, whose optimizer container and checkpoint helpers the torch-contract
# tests drive, install with --no-deps so that they keep the torch installed first (torchtitan's
# optimizer components need only tyro and spmd_types of its requirements: the dev extra has them).
# gram-newton-schulz (the Gram iteration's reference) likewise: its CUDA kernels are not installed,
# and its pure-torch path needs none of them.
PY ?= python3
VENV ?= .venv
VENV_FLAGS ?=
TORCH ?= torch==2.13.0
TORCHAO ?= torchao==0.18.0
TORCHTITAN ?= torchtitan==0.3.0
GRAMNS ?= gram-newton-schulz==0.1.6
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-optax notebooks lint bench docs clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV_FLAGS) $(VENV)
	$(if $(TORCH),$(BIN)/python -m pip install -q "$(TORCH)")
	$(BIN)/python -m pip install -q -e ".[dev,jax]"
	$(BIN)/python -m pip install -q --no-deps "$(TORCHAO)" "$(TORCHTITAN)" "$(GRAMNS)"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m zero demo

test: $(STAMP) lint
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=30

# Optax's own test modules against zero.functional, with the Rosenbrock convergence runs `make test` leaves out.
test-optax: $(STAMP)
	ZERO_OPTAX_FULL=1 $(BIN)/python -m pytest -q tests/functional/test_optax_suite.py tests/functional/test_optax_convergence.py

# The notebooks at full size (`make test` runs them small: ZERO_NOTEBOOK_SIZE=small, fewer steps, the same checks).
notebooks: $(STAMP)
	ZERO_NOTEBOOK_SIZE=full $(BIN)/python -m pytest -q -n 2 --dist loadgroup notebooks

# The documentation site from docs/ into site/ (mkdocs-material, the API reference from the docstrings).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: $(STAMP)
	$(BIN)/ruff check zero tests bench

bench: $(STAMP)
	$(BIN)/python bench/plan_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis site
