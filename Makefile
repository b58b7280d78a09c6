# gradsync: `make train` and `make test` each set everything up on a fresh machine first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=
PYTEST_ARGS ?=
# test processes pytest-xdist runs side by side: the suite's jobs wait on process start-up,
# barriers and timeouts as much as they compute, so 2 finish on 2 cores in about 2/3 the time
TEST_JOBS ?= 2
STARTUP_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help install train test test-fast lint sweep race network-check bench bench-gpt gpu-check gpu-check-dry \
	gpu-wheels compat clean distclean

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
	$(BIN)/python -m pytest -n $(TEST_JOBS) $(PYTEST_ARGS)

test-fast: install ## the edit loop: every test that starts no job process (-m "not slow"): units, exactness, 2-rank cases on the pool
	$(BIN)/python -m pytest -n $(TEST_JOBS) -m "not slow" $(PYTEST_ARGS)

lint: install ## ruff, mypy and import-linter (the layers: docs/architecture.md#layers)
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy
	$(BIN)/lint-imports

sweep: install ## multirun N=1,2,4,8 (experiment=accum_sweep); summary, plot in the sweep dir
	$(BIN)/gradsync-train -m experiment=accum_sweep $(ARGS)

BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP) requirements-bench.lock
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements-bench.lock
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP) ## side-by-side benchmark (also installs Lightning/Accelerate); BENCH_ARGS=--rounds 1
	$(BIN)/python bench/run.py $(BENCH_ARGS)
	$(BIN)/python bench/startup.py $(STARTUP_ARGS)

# nanoGPT's GPT through gradsync beside a hand-written nanoGPT-style loop (docs/benchmark.md). nanoGPT
# is not part of gradsync: NANOGPT=<a clone of karpathy/nanoGPT> (measured at commit 3adf61e).
NANOGPT ?=
BENCH_GPT_ARGS ?=
bench-gpt: install ## nanoGPT's GPT: gradsync vs a nanoGPT-style loop, tokens/s (~5 min); NANOGPT=<clone of karpathy/nanoGPT>
	$(BIN)/python bench/gpt.py --nanogpt "$(NANOGPT)" $(BENCH_GPT_ARGS)

network-check: install ## the projection against ranks over shaped links (root): docs/slow-network.md
	$(BIN)/python bench/slow_network.py $(ARGS)

race: install ## which policy wins: 7 sync policies on the stdlib corpus (experiment=policy_race)
	$(BIN)/gradsync-train -m experiment=policy_race $(ARGS)

# Another torch than the lock's: a venv of its own (.venv-torch-<version>, ignored) with that
# torch from the registry (its CUDA build and nvidia-* wheels: they also run on a CPU) and the
# lock's other pins, then the exactness and resume tests in it. The first run downloads a few
# GB; a set-up venv reinstalls nothing.
TORCH ?=
COMPAT_VENV := .venv-torch-$(TORCH)
COMPAT_TESTS ?= tests/test_torch_ddp.py tests/test_uneven.py tests/test_resume.py \
	tests/test_local_sgd.py tests/test_layer_sync.py tests/test_powersgd.py tests/test_precision.py \
	tests/test_checkpoint.py tests/test_units.py tests/test_torch_compat.py tests/test_gradsync_ddp.py
compat: ## another torch: make compat TORCH=2.11.0 (venv .venv-torch-2.11.0; exactness and resume tests)
	@test -n "$(TORCH)" || { echo "usage: make compat TORCH=<version>, e.g. TORCH=2.11.0" >&2; exit 2; }
	@test -f $(COMPAT_VENV)/.installed || { \
	  set -e; test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV); \
	  grep -v '^torch==' requirements.lock > $(COMPAT_VENV)/lock-without-torch.txt; \
	  $(COMPAT_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
	    "torch==$(TORCH)" -r $(COMPAT_VENV)/lock-without-torch.txt; \
	  touch $(COMPAT_VENV)/.installed; }
	PYTHONPATH=$(CURDIR)/src $(COMPAT_VENV)/bin/python -m pytest -p no:cacheprovider -q \
	  $(COMPAT_TESTS) $(PYTEST_ARGS)

# The GPU check. `make gpu-check` runs it with .venv (CPU torch: on a machine with a GPU that is
# a failure saying so); on a GPU machine use its own CUDA Python: `make gpu-check PY=python3`
# installs gradsync, Hydra and pytest from the wheelhouse $(WHEELS) (make gpu-wheels, built where
# the registry is reachable; never torch) into a private directory only the check's processes
# see, and leaves that Python's packages alone. It needs torch and tensorboard there.
PY ?= $(BIN)/python
WHEELS ?= build/gpu-wheels
GPU_CHECK_ARGS ?=
# pinned by requirements.lock; PyYAML is the one binary: a wheel for each CPython 3.10-3.13 and
# Linux x86_64/aarch64 (pure Python 3.10 needs exceptiongroup and tomli for pytest)
GPU_WHEEL_PINS := hydra-core omegaconf antlr4-python3-runtime packaging pytest pytest-timeout \
	pluggy iniconfig Pygments
gpu-check: $(if $(filter $(BIN)/python,$(PY)),$(STAMP)) ## GPU check (policies on 2 ranks/GPU, nccl, resume, host syncs, memory, tokens/s): outputs/gpu-check/report.md; PY=python3 WHEELS=dir on a GPU box
	$(if $(filter $(BIN)/python,$(PY)),PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} )$(PY) \
	  bench/gpu_check.py $(if $(filter $(BIN)/python,$(PY)),,--wheels $(WHEELS)) $(GPU_CHECK_ARGS)

gpu-wheels: $(STAMP) ## the wheelhouse make gpu-check PY=... installs from (gradsync, Hydra, pytest; no torch): build/gpu-wheels
	rm -rf $(WHEELS) && mkdir -p $(WHEELS)
	$(BIN)/python -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation \
	  --wheel-dir $(WHEELS) .
	for pin in $(GPU_WHEEL_PINS); do grep -i "^$$pin==" requirements.lock; done > $(WHEELS)/pins.txt
	$(BIN)/python -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir $(WHEELS) \
	  -r $(WHEELS)/pins.txt
	for py in 3.10 3.11 3.12 3.13; do for plat in x86_64 aarch64; do \
	  $(BIN)/python -m pip download --quiet --disable-pip-version-check --no-deps \
	    --only-binary=:all: --python-version $$py --platform manylinux2014_$$plat \
	    --dest $(WHEELS) "$$(grep -i '^PyYAML==' requirements.lock)" || exit 1; done; done
	$(BIN)/python -m pip download --quiet --disable-pip-version-check --no-deps \
	  --only-binary=:all: --python-version 3.10 --dest $(WHEELS) exceptiongroup tomli
	@ls $(WHEELS) | grep -c whl | xargs printf "gpu-wheels: %s wheels in $(WHEELS), "; du -sh $(WHEELS) | cut -f1

# The same check on the CPU with gloo, in a Python without Hydra or pytest (.venv-gpu-dry: only
# torch, tensorboard and numpy, at the lock's versions), from the wheelhouse: CI runs it.
DRY_VENV := .venv-gpu-dry
$(DRY_VENV)/.installed: requirements.lock
	test -x $(DRY_VENV)/bin/python || $(PYTHON) -m venv $(DRY_VENV)
	$(DRY_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
	  -c requirements.lock torch tensorboard numpy
	! $(DRY_VENV)/bin/python -c "import hydra" 2>/dev/null
	touch $@

gpu-check-dry: gpu-wheels $(DRY_VENV)/.installed ## every step of gpu-check on the CPU (gloo), Hydra-less Python, from the wheelhouse
	$(DRY_VENV)/bin/python bench/gpu_check.py --dry-run --wheels $(WHEELS) $(GPU_CHECK_ARGS)

clean: ## remove run outputs and caches (keeps .venv)
	rm -rf outputs/runs outputs/sweeps multirun .pytest_cache .mypy_cache .ruff_cache \
	  .import_linter_cache
	find . -name __pycache__ -not -path './$(VENV)/*' -exec rm -rf {} +

distclean: clean ## also remove the virtual environments and the GPU wheelhouse
	rm -rf $(VENV) $(DRY_VENV) .venv-torch-* build/gpu-wheels
