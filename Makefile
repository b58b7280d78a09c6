# gradsync: `make train` and `make test` each set everything up on a fresh machine first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=
PYTEST_ARGS ?=
STARTUP_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help install train test test-fast lint sweep race bench gpu-check clean distclean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

install: $(STAMP) ## set-up only: .venv with pinned deps (torch==2.13.0 CPU) and gradsync editable

# Re-runs only when the lock or pyproject changes: a set-up machine reinstalls nothing.
$(STAMP): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $(STAMP)

train: install ## run the default experiment (digits, MLP, 2 workers, accumulate N=4, fp32); ARGS=overrides
	$(BIN)/gradsync-train $(ARGS)

test: install ## run the whole test suite (unit + multi-process gloo tests + real jobs), what CI runs
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: install ## the edit loop: unit tests and 2-rank cases on the pool, no job started (-m "not slow")
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

lint: install ## ruff and mypy
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy

sweep: install ## multirun N=1,2,4,8 (experiment=accum_sweep); summary, plot in the sweep dir
	$(BIN)/gradsync-train -m experiment=accum_sweep $(ARGS)

BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP) requirements-bench.lock
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements-bench.lock
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP) ## side-by-side benchmark (also installs Lightning/Accelerate); BENCH_ARGS=--rounds 1
	$(BIN)/python bench/run.py $(BENCH_ARGS)
	$(BIN)/python bench/startup.py $(STARTUP_ARGS)

race: install ## which policy wins: 6 sync policies on the stdlib corpus (experiment=policy_race)
	$(BIN)/gradsync-train -m experiment=policy_race $(ARGS)

# PY=python3: a machine whose python3 already has CUDA torch (no venv is built then); gradsync
# comes from this checkout's src/ either way.
PY ?= $(BIN)/python
GPU_CHECK_ARGS ?=
gpu-check: $(if $(filter $(BIN)/python,$(PY)),$(STAMP)) ## GPU check (tests marked gpu, nccl, bf16/fp16, resume, LM tokens/s): outputs/gpu-check/report.md
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean: ## remove run outputs and caches (keeps .venv)
	rm -rf outputs/runs outputs/sweeps multirun .pytest_cache .mypy_cache .ruff_cache
	find . -name __pycache__ -not -path './$(VENV)/*' -exec rm -rf {} +

distclean: clean ## also remove the virtual environment
	rm -rf $(VENV)
