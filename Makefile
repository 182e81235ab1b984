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

# The suite runs in one pytest process per core (pytest-xdist; an idle process takes tests from a busy one's queue,
# so no long file holds the end of the run): PYTEST_WORKERS=0 runs it in this process. glibc's allocator keeps
# freed blocks of up to 32 MB for reuse (by default it hands each back to the kernel and faults it in again at the
# next training step: a fifth of a small CPU run's time). Inductor compiles in the test's own process (its pool of
# compile workers, each importing torch, cost the compiled tests more than it saved on 2 cores).
PYTEST_WORKERS ?= auto
TEST_ENV := GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296 \
	TORCHINDUCTOR_COMPILE_THREADS=1
PYTEST := $(TEST_ENV) $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal

# the suite without the tests marked slow (what CI runs; pyproject.toml's markers say what slow means)
test: $(VENV)/.installed
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

# every test, the slow ones too
test-all: $(VENV)/.installed
	$(PYTEST) $(PYTEST_ARGS)

docs: $(VENV)/.installed
	$(BIN)/python tools/gen_config_docs.py
	$(BIN)/python tools/gen_layout.py

clean:
	rm -rf $(VENV) runs .pytest_cache
