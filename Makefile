# Two commands do all the set-up on a fresh clone: `make demo` and `make test`.
#
# torch: on a machine without an NVIDIA GPU we first install a CPU build ($(TORCH_CPU)), which is
# small and fast to install; pyproject.toml only asks for `torch>=2.13` (the oldest the tests run on), so users are never pinned to it.
# Override for your machine, e.g. `make test TORCH_CPU='torch' TORCH_INDEX=https://download.pytorch.org/whl/cpu`.
PYTHON ?= python3
VENV ?= .venv
TORCH_CPU ?= torch==2.13.0
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint typecheck unit bench clean servers

setup: $(STAMP)

# Real programs the tests start: etcd (for `crashproof run --rdzv-backend etcd-v2`) and Chromium
# (renders `crashproof report`'s HTML headless). Installed with apt where we may; their tests skip,
# saying why, where they cannot be had.
servers:
	@for pair in etcd:etcd-server chromium:chromium; do \
		bin=$${pair%%:*}; pkg=$${pair#*:}; \
		if ! command -v $$bin >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
			(apt-get install -y -q $$pkg >/dev/null 2>&1 || \
			 (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $$pkg >/dev/null 2>&1)) || \
			echo "could not install $$pkg: the tests that need $$bin will be skipped"; \
		fi; \
	done

# Python's bytecode is written as each module is first imported, under the environment
# ($(VENV)/pycache, not beside the sources), so only what runs is ever compiled: byte-compiling
# every installed package (17,000 files) at set-up compiled nearly three times what the tests ever
# import (6,300 files), and took 30 of the 44 s of a fresh clone's set-up. Where
# PYTHONDONTWRITEBYTECODE is set, it is not passed on: every process would compile torch anew.
export PYTHONPYCACHEPREFIX ?= $(abspath $(VENV))/pycache
unexport PYTHONDONTWRITEBYTECODE

# The project and its test tools go in with uv where it can be had (5 s here, against pip's 45 s
# resolving the same set), else with pip, neither compiling anything; then one import of what
# nearly every test process imports compiles it once, before the tests start many at a time.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q --no-compile $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_CPU)"; \
	fi
	$(PY) -m pip install -q uv && $(VENV)/bin/uv pip install -q --python $(PY) -e ".[dev]" || \
		$(PY) -m pip install -q --no-compile -e ".[dev]"
	$(PY) -c 'import torch.distributed.run, torch.distributed.elastic.agent.server.local_elastic_agent, crashproof.cli, crashproof.supervisor.launch'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py --run-dir demo-runs

# ruff, and the parts' import order (pyproject.toml's [tool.importlinter], docs/architecture.md).
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# MKL's settings for bit-reproducible CPU math (docs/exactness.md), unless set already.
export MKL_CBWR ?= AUTO,STRICT
export MKL_DYNAMIC ?= FALSE

# Most tests in parallel, three workers on two cores (they spend much of their time waiting on
# processes they start; worksteal: a worker that runs out takes tests queued for another, so the
# last long ones do not run one after another on one worker), then the timing-sensitive ones
# alone, so that no other test skews the times they judge.
PYTEST_WORKERS ?= 3
PARALLEL_TESTS = $(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) --dist worksteal -m "not serial" --durations=15
SERIAL_TESTS = $(VENV)/bin/pytest -q -m serial

unit: $(STAMP) servers
	$(PARALLEL_TESTS)
	$(SERIAL_TESTS)

# lint and the type check run beside the parallel tests, on the cores those leave idle, and are
# done before the serial ones start; their output follows the parallel tests', and a failure of
# any of the three fails `make test`.
test: $(STAMP) servers
	@checks=$$(mktemp -d); \
	{ $(MAKE) -k --no-print-directory lint typecheck >$$checks/out 2>&1; echo $$? >$$checks/rc; } & \
	echo '$(PARALLEL_TESTS)'; $(PARALLEL_TESTS); tests=$$?; \
	wait; echo "--- lint and type check, run beside the tests:"; cat $$checks/out; \
	checked=$$(cat $$checks/rc); rm -r $$checks; \
	if [ $$checked != 0 ]; then echo "lint or the type check failed (above)"; fi; \
	if [ $$tests != 0 ]; then echo "the parallel tests failed (above)"; fi; \
	[ $$checked = 0 ] && [ $$tests = 0 ]
	$(SERIAL_TESTS)

bench: $(STAMP)
	$(PY) benchmarks/save_speed.py

clean:
	rm -rf $(VENV) demo-runs .mypy_cache .ruff_cache .pytest_cache .hypothesis
