# Quick start: `make demo` (the main job) and `make test` (the whole suite).
# Each sets up .venv with the machine's python3 on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export JAX_PLATFORMS ?= cpu
# Test processes (pytest-xdist); an idle one takes tests queued for another.
JOBS ?= auto

.PHONY: demo test lint install clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,plot,progress]"
	# Deviceless GPU compilation: the CUDA plugin pinned to the installed jaxlib.
	v=$$($(PY) -c 'import jaxlib; print(jaxlib.__version__)') && \
	  $(PY) -m pip install -q "jax-cuda13-plugin==$$v" "jax-cuda13-pjrt==$$v"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m jax_overlap.examples.demo $(ARGS)

test: $(STAMP)
	$(PY) -m ruff check jax_overlap tests benchmarks
	$(PY) -m ruff format --check jax_overlap tests benchmarks
	$(PY) -m pytest -q tests -n $(JOBS) --dist worksteal --durations=15 $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check jax_overlap tests benchmarks
	$(PY) -m ruff format --check jax_overlap tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info demo_out
