# Two entry points, both self-contained on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# Extra pip arguments for torch, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" where the
# default index would serve the CUDA build.
TORCH_PIP_ARGS ?=
# pytest-xdist workers for `make test`: the suite is mostly torchrun jobs, servers and waits, so on the 2-core CI
# machine two workers cut its time by about a third, and a third worker, taking the waits of the other two, ~490 s
# against ~630 s for two; 0 runs it in one process.
TEST_WORKERS ?= 3

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch first, pinned, so the project's dependencies never pull another (CUDA) build.
	$(VENV)/bin/pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(VENV)/bin/pip install -q -e '.[dev,s3]'
	touch $@

.PHONY: setup demo test bench
setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/hotload demo

test: setup
	$(VPY) -m pytest -q -p no:cacheprovider --durations=20 -n $(TEST_WORKERS) --dist worksteal tests

bench: setup
	$(VPY) benchmarks/codec.py
