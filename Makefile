# Two commands on a fresh machine: `make demo` and `make test`.
# The virtual environment is created when missing; torch is installed explicitly first (a bare
# `torch` requirement in a fresh environment would pull the multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test test-fast docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/paratron demo

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

docs: $(VENV)/.installed
	$(BIN)/python tools/gen_config_docs.py
	$(BIN)/python tools/gen_layout.py

clean:
	rm -rf $(VENV) runs .pytest_cache
