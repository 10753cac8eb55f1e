# make run: create .venv, install, run the main job on the embedded default model.
# make test: create .venv, install, lint (ruff), run the test suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0" || $(PY) -m pip install --quiet "torch>=2.6"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

# MODEL=dir-or-hub-id overrides the embedded default model.
MODEL_FLAG := $(if $(MODEL),--model $(MODEL))
CODE_PROMPT := $$'def read_lines(path):\n    """Return the lines of the file at path, without newlines."""\n'

run: $(STAMP)
	$(VENV)/bin/deltaspec generate $(MODEL_FLAG) $(CODE_PROMPT) \
		--max-tokens 60 --repetition-penalty 1.15
	$(VENV)/bin/deltaspec chat $(MODEL_FLAG) --message "Write a function that reverses a string." \
		--max-tokens 80 --repetition-penalty 1.1

# One test process per core (pytest-xdist), each with one torch thread: on CI's two cores about 1.6x faster than
# one process with two threads. With CUDA the tests run in one process (they would share one GPU); TEST_WORKERS=N
# overrides, 0 runs them in pytest's own process.
TEST_WORKERS ?= $(shell $(PY) -c "import torch; print(0 if torch.cuda.is_available() else 'auto')" 2>/dev/null || echo auto)
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@if ! $(PY) -c "import triton" 2>/dev/null; then \
		$(PYTEST) && echo "Kernel tests skipped: triton does not import (the test extra installs it on Linux x86_64 and aarch64 only)"; \
	elif $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		$(PYTEST); \
	else \
		echo "The tests but the kernel tests, then the kernel tests under TRITON_INTERPRET=1:"; \
		$(PYTEST) -m "not kernel" && TRITON_INTERPRET=1 $(PYTEST) -m kernel; \
	fi

clean:
	rm -rf $(VENV)
