# Two entry points, both self-contained on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# The CPU build of torch first, so nothing pulls CUDA wheels.
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[dev,s3]'
	touch $@

.PHONY: setup demo test bench
setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/hotload demo

test: setup
	$(VPY) -m pytest -q -p no:cacheprovider tests

bench: setup
	$(VPY) benchmarks/codec.py
