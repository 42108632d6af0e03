# Two commands set everything up from nothing: `make demo` (the main job) and `make test` (ruff + the suite on both
# stacks). Two virtual environments, one per stack:
#   .venv         the XLA stack: torch 2.9 + torch_xla 2.9 (the `[xla]` extra): the main job and the whole suite;
#   .venv-newest  the newest stack: the newest torch that installs here, no torch_xla: every test not marked `xla`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NEWEST_VENV ?= .venv-newest
NEWEST_PY := $(NEWEST_VENV)/bin/python
NEWEST_STAMP := $(NEWEST_VENV)/.installed
NEWEST_TORCH ?= 2.14.1
# The HTML report's browser test drives Debian's chromium (tests/browser.py); installed only where it is missing.
CHROMIUM := /usr/bin/chromium

.PHONY: demo test test-xla test-newest stacks lint bench chaos clean

# Modules are compiled once, when first imported, and their bytecode kept, even where the environment says not to
# write it (these machines set PYTHONDONTWRITEBYTECODE): else each of the suite's hundreds of processes, and each
# run of the demo, would compile everything it imports again.
unexport PYTHONDONTWRITEBYTECODE

# The package's requirements with the extras named as arguments, one per line, read from pyproject.toml: the two
# environments install them at the same time; the editable installs of the one checkout (which write its
# *.egg-info) then take turns under a lock.
REQUIREMENTS = $(PYTHON) -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	print(*p["dependencies"], *(r for extra in sys.argv[1:] for r in p["optional-dependencies"][extra]), sep="\n")'
# Packages are installed by uv (from the registry, pinned), which fetches and unpacks wheels in parallel and keeps
# one cache for both environments, resolving the same versions as pip (the XLA environment at load 14: 906 s with
# pip, 261 s with uv). uv does not read pip's configuration, so the machine's pip settings
# (constraints that cap torch, local wheels, extra indexes) are passed on as flags, and candidates are chosen
# across indexes as pip chooses them. Nothing is byte-compiled at install: of the XLA environment's 13,400 modules
# the suite imports about a quarter, compiled when first imported and kept (below); compiling them all took
# 40 CPU-s and 28 s before the XLA suite could start.
UV_VERSION := 0.13.10
UV_FLAGS = $(shell $(PYTHON) -m pip config list 2>/dev/null | $(PYTHON) -c 'import shlex, sys; \
	flags = {"constraint": "--constraint", "find-links": "--find-links", "index-url": "--index-url", \
	         "extra-index-url": "--extra-index-url"}; \
	pairs = dict.fromkeys((flags[k.split(".")[-1]], v) for k, _, q in (l.strip().partition("=") for l in sys.stdin) \
	                      if k.split(".")[-1] in flags for v in " ".join(shlex.split(q)).split()); \
	print(*(x for pair in pairs for x in pair))') --index-strategy unsafe-best-match
INSTALL = $(1)/bin/uv pip install --quiet --python $(1)/bin/python $(UV_FLAGS)
EDITABLE = flock .install.lock $(call INSTALL,$(1)) --no-deps -e .

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv==$(UV_VERSION)
	$(REQUIREMENTS) xla test | $(call INSTALL,$(VENV)) -r /dev/stdin
	$(call EDITABLE,$(VENV))
	touch $(STAMP)

$(NEWEST_STAMP): pyproject.toml
	test -x $(NEWEST_PY) || $(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_PY) -m pip install --quiet uv==$(UV_VERSION)
	( $(REQUIREMENTS) test trainers; echo 'torch==$(NEWEST_TORCH)' ) | \
		$(call INSTALL,$(NEWEST_VENV)) -r /dev/stdin
	$(call EDITABLE,$(NEWEST_VENV))
	touch $(NEWEST_STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Both environments (and the browser), set up at the same time.
stacks:
	$(MAKE) --no-print-directory -j3 $(STAMP) $(NEWEST_STAMP) $(CHROMIUM)

$(CHROMIUM):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

# The browser, installed once whichever of two concurrent recipes asks first (the other waits for it).
CHROMIUM_ONCE = flock .chromium.lock $(MAKE) --no-print-directory $(CHROMIUM)

# Tests run on several workers: many wait on subprocesses, servers and retries, so more workers than cores help
# (a worker was busy half of the time with two per stack). The two stacks run at the same time, each on its own
# workers, and each prints its own summary at the end; the XLA stack runs more tests and ends last, so it has one
# worker more. `make test-xla` or `make test-newest` runs one of them (TEST_WORKERS=0: in one process).
# `make test` installs the newest stack while the XLA stack's suite already runs (an install mostly waits for
# the disk); the XLA suite's cross-stack tests wait for that install (XTC_NEWEST_READY: its stamp; the stamp's
# `.failed` if it failed).
TEST_WORKERS ?= 2
XLA_TEST_WORKERS ?= $(if $(filter 0,$(TEST_WORKERS)),0,$(shell expr $(TEST_WORKERS) + 1))
PYTEST_XLA := XTC_NEWEST_PYTHON=$(abspath $(NEWEST_PY)) $(PY) -m pytest -q -p no:cacheprovider -n $(XLA_TEST_WORKERS) \
	--dist worksteal
# The newest stack's fuzzing runs the generated hostile cases after the XLA stack's (the same code reads both).
PYTEST_NEWEST := $(NEWEST_PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal -m "not xla" \
	--hostile-start 300

test:
	@rm -f .test-xla.log .test-newest.log .test-xla.rc .test-newest.rc $(NEWEST_STAMP).failed
	@( if $(MAKE) --no-print-directory $(NEWEST_STAMP) > .install-newest.log 2>&1 && $(CHROMIUM_ONCE); then \
	     $(PYTEST_NEWEST) > .test-newest.log 2>&1; echo $$? > .test-newest.rc; \
	   else cp .install-newest.log .test-newest.log; mkdir -p $(NEWEST_VENV); touch $(NEWEST_STAMP).failed; \
	     echo 1 > .test-newest.rc; fi ) & \
	 if $(MAKE) --no-print-directory $(STAMP) && $(CHROMIUM_ONCE) && $(VENV)/bin/ruff check .; then \
	   XTC_NEWEST_READY=$(abspath $(NEWEST_STAMP)) $(PYTEST_XLA) > .test-xla.log 2>&1; echo $$? > .test-xla.rc; \
	 else echo 1 > .test-xla.rc; fi; \
	 wait
	@echo "=== XLA stack: torch 2.9 + torch_xla 2.9 (the whole suite) ==="; cat .test-xla.log
	@echo "=== newest stack: torch $(NEWEST_TORCH), no torch_xla (tests marked xla deselected) ==="; cat .test-newest.log
	@test "$$(cat .test-xla.rc)" = 0 && test "$$(cat .test-newest.rc)" = 0

test-xla: lint $(NEWEST_STAMP) $(CHROMIUM)  # tests/test_cross_stack.py runs jobs on the newest stack
	$(PYTEST_XLA)

test-newest: lint $(NEWEST_STAMP) $(CHROMIUM)
	$(PYTEST_NEWEST)

# Every benchmark case (benchmarks/cases.py), one after the other, each writing benchmarks/results/NAME.{json,txt};
# then docs/performance.md's generated tables. One case: `$(PY) -m benchmarks NAME [--quick]`.
bench: $(STAMP)
	$(call INSTALL,$(VENV)) -e '.[xla,test,bench]'
	$(PY) -m benchmarks --all
	$(PY) -m benchmarks.report

chaos: $(STAMP)  # the long chaos run (docs/reliability.md); CHAOS_ARGS="--seed 7 --cycles 42" replays a seed
	$(PY) tests/chaos.py $(or $(CHAOS_ARGS),--seeds 3 --cycles 100)

clean:
	rm -rf $(VENV) $(NEWEST_VENV) build *.egg-info .test-*.log .test-*.rc .install.lock .install-newest.log \
		.chromium.lock xla_tensorstore_ckpt/incremental/_xor_at.*.so
