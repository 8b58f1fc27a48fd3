# Quick start: `make demo` (the main job) and `make test` (the whole suite).
# Each sets up .venv with the machine's python3 on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export JAX_PLATFORMS ?= cpu
# Test processes (pytest-xdist); an idle one takes tests queued for another.
JOBS ?= auto

.PHONY: demo test test-jax lint install clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# uv installs what pip would, in a third of the time; pip does it where uv is not to be had.
	# Both compile the packages' bytecode (uv only when asked): where PYTHONDONTWRITEBYTECODE
	# is set, every process (each test process, subprocess and notebook kernel) would
	# otherwise compile jax's sources again on import, 2-3 s each on 2 cores.
	# Deviceless GPU compilation: the CUDA plugin pinned to the installed jaxlib.
	$(PY) -m pip install -q uv || true
	if test -x $(VENV)/bin/uv; then pip="$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY)"; \
	  else $(PY) -m pip install -q --upgrade pip; pip="$(PY) -m pip install -q"; fi; \
	$$pip -e ".[test,plot,progress]" && \
	v=$$($(PY) -c 'import jaxlib; print(jaxlib.__version__)') && \
	$$pip "jax-cuda13-plugin==$$v" "jax-cuda13-pjrt==$$v"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m jax_overlap.examples.demo $(ARGS)

test: $(STAMP)
	$(PY) -m ruff check jax_overlap tests benchmarks
	$(PY) -m ruff format --check jax_overlap tests benchmarks
	$(PY) -m compileall -q jax_overlap tests  # the project's own bytecode, likewise
	$(PY) -m pytest -q tests -n $(JOBS) --dist worksteal --durations=15 $(ARGS)

# The suite against another jax release in its own venv, e.g. the GPU machines' 0.11.2
# (Python 3.12 or later): `make test-jax JAX=0.11.2 PYTHON=python3.12`. JAX=latest takes the
# newest release the package index serves that interpreter with a CUDA plugin of the same
# version (jax uses a plugin only when its version is jaxlib's: .ci/newest_jax.py).
# From Python 3.12 it also installs MaxText's train step (the maxtext extra: tests/test_maxtext.py).
JAX ?= 0.11.2
test-jax:
	v='$(JAX)'; \
	if test "$$v" = latest; then v=$$($(PYTHON) .ci/newest_jax.py) || exit 1; fi; \
	venv=.venv-jax$$v; echo "jax $$v in $$venv"; \
	test -x $$venv/bin/python || $(PYTHON) -m venv $$venv || exit 1; \
	$$venv/bin/python -m pip install -q uv && \
	$$venv/bin/uv pip install -q --compile-bytecode --python $$venv/bin/python \
	  -e ".[test,plot,progress,maxtext]" \
	  "jax==$$v" "jaxlib==$$v" "jax-cuda13-plugin==$$v" "jax-cuda13-pjrt==$$v" && \
	$$venv/bin/python -m pytest -q tests -n $(JOBS) --dist worksteal --durations=15 $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check jax_overlap tests benchmarks
	$(PY) -m ruff format --check jax_overlap tests benchmarks

clean:
	rm -rf $(VENV) .venv-jax* build *.egg-info demo_out
