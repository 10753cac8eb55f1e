# make run: create .venv, install, run the main job on the embedded default model.
# make test: create .venv, install, run the test suite.
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
run: $(STAMP)
	$(VENV)/bin/deltaspec generate $(if $(MODEL),--model $(MODEL)) --prompt "def fibonacci(n):" --max-tokens 48

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
