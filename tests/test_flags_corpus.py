"""validate() against what jaxlib really does with XLA_FLAGS, on a corpus of 200+ strings.

Each string of tests/data/xla_flags_corpus.json (public recipes, XLA's own flag
list, spellings users get wrong) is run here through a fresh Python process
that sets XLA_FLAGS and starts jax's CPU backend: whether it aborts is the
label. validate() must report an error exactly for the strings that abort.

The processes are forked from a server that has imported jax (and started no backend,
so XLA has read no flags yet): each child sets XLA_FLAGS and calls ``jax.devices()``, as
a user's job does, without paying for the import 200 times. The labels stored with the
corpus were recorded with a plain ``python -c "import jax; jax.devices()"`` per string;
``test_stored_labels_are_this_jaxlibs`` compares the two on the jaxlib they were
recorded with.
"""

import collections
import json
import multiprocessing
import os

import jaxlib
import pytest
import xla_flags_child

from jax_overlap import flags

CORPUS = json.load(open(os.path.join(os.path.dirname(__file__), "data", "xla_flags_corpus.json")))
STRINGS = [e["xla_flags"] for e in CORPUS["entries"]]


@pytest.fixture(scope="module")
def truth() -> list[bool]:
  saved = {k: os.environ.pop(k) for k in ("LD_PRELOAD",) if k in os.environ}
  try:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["jax", xla_flags_child.__name__])
    aborts: dict[int, bool] = {}
    pending = collections.deque(enumerate(STRINGS))
    running: collections.deque = collections.deque()
    while pending or running:
      while pending and len(running) < 4:
        i, text = pending.popleft()
        proc = ctx.Process(target=xla_flags_child.start, args=(text,))
        proc.start()
        running.append((i, proc))
      i, proc = running.popleft()
      proc.join(timeout=300)
      if proc.is_alive():
        proc.kill()
        pytest.fail(f"starting jax with XLA_FLAGS={STRINGS[i]!r} hung for 300 s")
      aborts[i] = proc.exitcode != 0
    return [aborts[i] for i in range(len(STRINGS))]
  finally:
    os.environ.update(saved)


@pytest.mark.slow
def test_corpus_is_large_and_mixed(truth):
  assert len(set(STRINGS)) == len(STRINGS) >= 200
  assert sum(truth) >= 50 and len(truth) - sum(truth) >= 50


def test_validate_errors_exactly_where_xla_aborts(truth):
  false_alarms, missed = [], []
  for text, aborts in zip(STRINGS, truth):
    errors = [p for p in flags.validate(text) if p.severity == "error"]
    if errors and not aborts:
      false_alarms.append((text, [p.message for p in errors]))
    if aborts and not errors:
      missed.append(text)
  assert false_alarms == []
  assert missed == []


def test_stored_labels_are_this_jaxlibs(truth):
  if jaxlib.__version__ != CORPUS["jaxlib"]:
    pytest.skip(f"labels were recorded on jaxlib {CORPUS['jaxlib']}, not {jaxlib.__version__}")
  stored = [e["aborts"] for e in CORPUS["entries"]]
  changed = [s for s, a, b in zip(STRINGS, stored, truth) if a != b]
  assert changed == []


def test_without_probe_registry_flags_are_judged_by_syntax(truth):
  # With probe=False only the registry's flags and XLA's syntax rules are known: every error
  # it reports must still be a real abort.
  for text, aborts in zip(STRINGS, truth):
    errors = [p for p in flags.validate(text, probe=False) if p.severity == "error"]
    assert not errors or aborts, (text, errors)
