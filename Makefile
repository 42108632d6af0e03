# Two commands set everything up from nothing: `make demo` (the main job) and `make test` (ruff + the suite).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Tests run on several workers: many wait on subprocesses, servers and retries, so more workers than cores help
# (3 on this 2-core machine); `make test TEST_WORKERS=0` runs them in one process.
TEST_WORKERS ?= 3

test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
