# The two set-up commands: `make run` and `make test`. Both install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test install bench-overhead clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/switchyard up --engine sim

test: install
	$(PY) -m pytest -q

bench-overhead: install
	$(VENV)/bin/switchyard bench overhead --out bench/results/overhead

clean:
	rm -rf $(VENV) build *.egg-info
