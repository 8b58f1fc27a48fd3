"""The build: setup.py's recipe, the Bazel BUILD file and the built libraries agree."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess

import pytest

from jax_overlap import _lib
from jax_overlap._src.runtime import library as runtime

REPO = pathlib.Path(__file__).resolve().parents[1]


def _bazel_targets() -> dict[str, dict[str, list[str]]]:
  """name -> {"srcs": [...], "hdrs": [...]} for every rule in BUILD (Starlark subset)."""
  text = (REPO / "BUILD").read_text()
  out = {}
  for m in re.finditer(r"\n(cc_library|cc_binary)\((.*?)\n\)", text, re.S):
    body = m.group(2)
    name = re.search(r'name = "([^"]+)"', body).group(1)
    lists = {}
    for key in ("srcs", "hdrs"):
      lm = re.search(key + r" = \[(.*?)\]", body, re.S)
      lists[key] = re.findall(r'"([^"]+)"', lm.group(1)) if lm else []
    out[name] = lists
  return out


def test_bazel_source_lists_match_the_setup_recipe():
  targets = _bazel_targets()
  pairs = {
    _lib.RUNTIME_LIBRARY: "jax_overlap_rt_lib",
    _lib.FFI_LIBRARY: "jax_overlap_ffi_lib",
  }
  for lib_name, bazel_name in pairs.items():
    recipe = _lib.LIBRARIES[lib_name]
    assert sorted(targets[bazel_name]["srcs"]) == sorted(recipe["sources"]), lib_name
    assert sorted(targets[bazel_name]["hdrs"]) == sorted(recipe["headers"]), lib_name
    assert lib_name in targets  # the shared-object cc_binary
  for rel in [p for t in targets.values() for p in t["srcs"] + t["hdrs"]]:
    assert (REPO / rel).is_file(), rel


def test_setup_py_builds_from_the_same_recipe():
  tree = ast.parse((REPO / "setup.py").read_text())
  calls = [
    n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"
  ]
  assert len(calls) == 1
  keywords = {k.arg for k in calls[0].keywords}
  assert {"ext_modules", "cmdclass"} <= keywords
  assert "jax_overlap/_lib/__init__.py" in (REPO / "setup.py").read_text()


def test_every_source_file_is_built():
  listed = {p for spec in _lib.LIBRARIES.values() for p in (*spec["sources"], *spec["headers"])}
  on_disk = {
    str(p.relative_to(REPO))
    for p in (REPO / "xla_patches").rglob("*")
    if p.suffix in (".cc", ".h") and "testing" not in p.parts
  }
  assert on_disk == listed


@pytest.mark.slow
def test_runtime_library_exports_only_its_api():
  lib = runtime.library_path(runtime.RUNTIME_LIBRARY)
  out = subprocess.run(
    ["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True
  ).stdout
  names = {line.split()[-1] for line in out.splitlines() if line.split()[1] in "TtWw"}
  names = {n for n in names if not n.startswith("_")}  # C++ runtime template instances
  header = (REPO / "xla_patches/runtime/hooks.h").read_text()
  hooked = header[
    header.index("#define JOR_HOOKED_SYMBOLS") : header.index("#define JOR_USED_SYMBOLS")
  ]
  hooks = re.findall(r"^  X\((cu\w+),", hooked, re.M)
  assert len(hooks) == 23
  # Exactly the listed driver symbols are exported, no more.
  assert {n for n in names if n.startswith("cu")} == set(hooks)
  assert "dlsym" in names
  assert {n for n in names if not n.startswith(("cu", "jor_"))} == {"dlsym"}


def test_runtime_library_carries_its_cxx_runtime():
  # Preloaded into every process of a job: it must not pull libstdc++/libgcc_s in.
  lib = runtime.library_path(runtime.RUNTIME_LIBRARY)
  out = subprocess.run(["ldd", str(lib)], capture_output=True, text=True, check=True).stdout
  needed = [line.split()[0] for line in out.splitlines() if line.strip()]
  assert not [n for n in needed if n.startswith(("libstdc++", "libgcc_s"))], needed
