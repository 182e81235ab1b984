# Two commands on a fresh machine: `make demo` and `make test`.
# The virtual environment is created when missing; torch is installed explicitly first (a bare
# `torch` requirement in a fresh environment would pull the multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test test-all docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/paratron demo

# the suite without the tests marked slow (what CI runs; pyproject.toml's markers say what slow means)
test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

# every test, the slow ones too
test-all: $(VENV)/.installed
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

docs: $(VENV)/.installed
	$(BIN)/python tools/gen_config_docs.py
	$(BIN)/python tools/gen_layout.py

clean:
	rm -rf $(VENV) runs .pytest_cache
