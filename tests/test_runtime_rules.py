"""The runtime library's rule parsing on its own: rules.cc and log.cc build and run without
a driver, dlopen or CUDA (xla_patches/testing/rules_test.cc holds the cases)."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

from jax_overlap import _lib
from jax_overlap._src.runtime import library as runtime

REPO = pathlib.Path(__file__).resolve().parents[1]
RUNTIME = REPO / "xla_patches" / "runtime"


@pytest.fixture(scope="module")
def rules_test(tmp_path_factory) -> pathlib.Path:
  out = tmp_path_factory.mktemp("rules_test") / "rules_test"
  spec = _lib.LIBRARIES[_lib.RUNTIME_LIBRARY]
  sources = [RUNTIME / "rules.cc", RUNTIME / "log.cc"]
  assert {str(s.relative_to(REPO)) for s in sources} <= set(spec["sources"])
  cflags = [f for f in spec["cflags"] if f not in ("-fPIC", "-fvisibility=hidden")]
  cmd = [runtime.compiler(), *cflags, "-Werror", "-o", str(out)]
  cmd += [str(REPO / "xla_patches" / "testing" / "rules_test.cc"), *map(str, sources)]
  subprocess.run(cmd, check=True, capture_output=True, text=True)
  return out


def test_rule_parsing_needs_no_driver(rules_test):
  undefined = subprocess.run(
    ["nm", "-u", str(rules_test)], capture_output=True, text=True, check=True
  ).stdout.split()
  assert not [s for s in undefined if s.startswith("cu")], undefined
  assert not [s for s in undefined if s.split("@")[0] in ("dlopen", "dlsym", "dlvsym")]


def test_rule_cases_pass(rules_test):
  run = subprocess.run([str(rules_test)], capture_output=True, text=True, timeout=60)
  assert run.returncode == 0, run.stdout + run.stderr
  checks = int(run.stdout.split("rules_test: ")[1].split()[0])
  assert checks > 100 and ", 0 failed" in run.stdout
  # Every ignored line is named on stderr, whatever the verbosity.
  assert "bad regex '(unclosed'" in run.stderr
  assert "ignoring line 'shaping\ton'" in run.stderr
  assert "bad stream index '-2'" in run.stderr
