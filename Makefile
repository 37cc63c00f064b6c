# Quick start:  make demo  (set up and run `plait explore` on its embedded default)
#               make test  (set up and run the whole test suite)
# Inside an activated virtualenv, that environment (and its torch) is used instead of .venv.
PYTHON ?= python3
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
BIN := $(VENV)/bin
STAMP := $(VENV)/.plait-installed
TORCH_CPU := torch==2.13.0
OUT ?= out

# The oldest torch plait supports (plait.runtime.MIN_TORCH): `make test-torch-low` runs on it.
TORCH_LOW := torch==2.11.0
VENV_LOW := .venv-torch-low

# torchtitan as its users install it: `make test-torchtitan` runs plait against it.
TITAN := torch==2.13.0 torchtitan==0.3.0 triton==3.9.0
VENV_TITAN := .venv-torchtitan

.PHONY: setup demo test test-fast test-torch-low test-torchtitan lint docs bench clean

$(STAMP): pyproject.toml requirements.lock
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null \
	  || $(BIN)/python -m pip install --disable-pip-version-check -q $(TORCH_CPU)
	$(BIN)/python -m pip install --disable-pip-version-check -q -c requirements.lock -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)

demo: setup
	@mkdir -p $(OUT)
	$(BIN)/plait explore --trace $(OUT)/explore-trace.json --plot $(OUT)/explore.png

test: setup
	$(BIN)/python -m pytest -q -n 2

test-fast: setup   # everything but the forked-rank tests (marked slow)
	$(BIN)/python -m pytest -q -n 2 -m "not slow"

test-torch-low:   # the whole suite on the oldest torch plait supports, in a venv of its own
	@test -x $(VENV_LOW)/bin/python || $(PYTHON) -m venv $(VENV_LOW)
	@$(VENV_LOW)/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(subst torch==,,$(TORCH_LOW))')" 2>/dev/null \
	  || $(VENV_LOW)/bin/python -m pip install --disable-pip-version-check -q $(TORCH_LOW)
	$(VENV_LOW)/bin/python -m pip install --disable-pip-version-check -q -c requirements.lock -e '.[dev]'
	$(VENV_LOW)/bin/python -m pytest -q -n 2

test-torchtitan:   # plait against torchtitan 0.3.0's own Llama3, in a venv of its own
	@test -x $(VENV_TITAN)/bin/python || $(PYTHON) -m venv $(VENV_TITAN)
	@$(VENV_TITAN)/bin/python -c "import torchtitan" 2>/dev/null \
	  || $(VENV_TITAN)/bin/python -m pip install --disable-pip-version-check -q $(TITAN)
	$(VENV_TITAN)/bin/python -m pip install --disable-pip-version-check -q -e . \
	  pytest pytest-xdist hypothesis
	$(VENV_TITAN)/bin/python -m pytest -q -n 2 tests/test_torchtitan.py

lint: setup
	$(BIN)/ruff check src tests bench examples
	$(BIN)/mypy

docs: setup   # the documentation site, strict: a missing page, anchor or named file fails
	$(BIN)/mkdocs build --strict --site-dir $(OUT)/site

bench: setup
	$(BIN)/python bench/explore_speed.py

clean:
	rm -rf $(OUT) .pytest_cache build src/*.egg-info
