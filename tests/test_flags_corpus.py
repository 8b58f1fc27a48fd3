"""validate() against what jaxlib really does with XLA_FLAGS, on a corpus of 200+ strings.

Each string of tests/data/xla_flags_corpus.json (public recipes, XLA's own flag
list, spellings users get wrong) is run here through a fresh Python process
that sets XLA_FLAGS and starts jax's CPU backend: whether it aborts is the
label. validate() must report an error exactly for the strings that abort.
"""

import concurrent.futures
import json
import os
import subprocess
import sys

import jaxlib
import pytest

from jax_overlap import flags

CORPUS = json.load(open(os.path.join(os.path.dirname(__file__), "data", "xla_flags_corpus.json")))
STRINGS = [e["xla_flags"] for e in CORPUS["entries"]]


def _aborts(text: str) -> bool:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LD_PRELOAD")}
  env.update(XLA_FLAGS=text, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, timeout=300
  )
  return proc.returncode != 0


@pytest.fixture(scope="module")
def truth() -> list[bool]:
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    return list(pool.map(_aborts, STRINGS))


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
