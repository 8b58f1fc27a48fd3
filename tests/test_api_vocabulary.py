"""The public API speaks one vocabulary (docs/glossary.md), and the earlier spellings still
work for one release with a warning that names the current one."""

import ast
import dataclasses
import importlib
import inspect
import json
import pathlib
import re
import subprocess
import sys
import typing
import warnings

import pytest

import jax_overlap
from jax_overlap._src.deprecations import JaxOverlapDeprecationWarning

# Names no public signature uses any more (the glossary's word on the right).
RETIRED = {"compiler_options": "xla_options", "model": "cost_model", "gpu_name": "target"}
# Functions of jax_overlap.targets are about a target: it is their subject, not a setting.
# So is plan_dict (the runtime plan for a target, built from the simulator's choices).
SUBJECT_TARGET = {
  "compile_only_devices",
  "compile_only_mesh",
  "gpu_target_config",
  "get",
  "get_gpu",
  "plan_dict",
}


def _public(module, seen):
  """(qualified name, object) of every public name, sub-packages included."""
  for name in getattr(module, "__all__", []):
    obj = getattr(module, name, None)
    if inspect.ismodule(obj):
      if obj.__name__.startswith("jax_overlap") and obj.__name__ not in seen:
        seen.add(obj.__name__)
        yield from _public(obj, seen)
    else:
      yield f"{module.__name__}.{name}", obj


def _functions():
  out = {
    full: obj
    for full, obj in _public(jax_overlap, {"jax_overlap"})
    if inspect.isfunction(obj) or (callable(obj) and not inspect.isclass(obj))
  }
  assert len(out) > 40  # the walk reached the sub-packages
  return out


def _classes():
  """Public classes: their constructors take settings too (and records' fields)."""
  out = {
    full: obj
    for full, obj in _public(jax_overlap, {"jax_overlap"})
    if inspect.isclass(obj) and obj.__module__.startswith("jax_overlap")
  }
  assert len(out) > 30
  return out


def test_public_signatures_use_the_glossary_names():
  problems = []
  for full, fn in sorted(_functions().items()):
    try:
      params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
      continue
    for p in params:
      if p.name in RETIRED:
        problems.append(f"{full}: {p.name}= (use {RETIRED[p.name]}=)")
      if (
        p.name == "target"
        and p.kind is not p.KEYWORD_ONLY
        and full.rsplit(".", 1)[-1] not in SUBJECT_TARGET
      ):
        problems.append(f"{full}: target is not keyword-only")
  assert problems == []


def test_glossary_lists_every_public_setting_name():
  import pathlib

  glossary = (pathlib.Path(__file__).parents[1] / "docs" / "glossary.md").read_text()
  for word in ("target", "xla_options", "cost_model", "constants", "workload", "policy"):
    assert f"`{word}`" in glossary


@pytest.mark.parametrize(
  "old, new, match",
  [
    (
      lambda: jax_overlap.flags.as_compiler_options("a100x8", "fsdp"),
      lambda: jax_overlap.flags.as_compiler_options(target="a100x8", workload="fsdp"),
      "target=, workload=",
    ),
    (
      lambda: jax_overlap.flags.as_compiler_options(
        target="h100x8", xla_gpu_enable_triton_gemm=False
      ),
      lambda: jax_overlap.flags.as_compiler_options(
        target="h100x8", xla_options={"xla_gpu_enable_triton_gemm": False}
      ),
      "xla_options=",
    ),
    (
      lambda: jax_overlap.flags.recommended("h100x8"),
      lambda: jax_overlap.flags.recommended(target="h100x8"),
      "target=",
    ),
    (
      lambda: jax_overlap.collective_matmul.estimate_gain(
        4096, 4096, 4096, 8, "bfloat16", "a100x8"
      ),
      lambda: jax_overlap.collective_matmul.estimate_gain(
        4096, 4096, 4096, 8, dtype="bfloat16", target="a100x8"
      ),
      "dtype=, target=",
    ),
    (
      lambda: (
        jax_overlap.sim.simulate(jax_overlap.sim.tail_effect(), "a100", "priority").makespan_s
      ),
      lambda: (
        jax_overlap.sim.simulate(
          jax_overlap.sim.tail_effect(), target="a100", policy="priority"
        ).makespan_s
      ),
      "target=, policy=",
    ),
    (
      lambda: jax_overlap.analysis.kernel_time(
        1e12, 1e9, jax_overlap.targets.get_gpu("h100"), model=jax_overlap.analysis.CostModel()
      ),
      lambda: jax_overlap.analysis.kernel_time(
        1e12, 1e9, jax_overlap.targets.get_gpu("h100"), cost_model=jax_overlap.analysis.CostModel()
      ),
      "use cost_model=",
    ),
  ],
)
def test_earlier_spellings_still_work_and_name_the_current_one(old, new, match):
  with pytest.warns(JaxOverlapDeprecationWarning, match=match) as record:
    value = old()
  # The warning points at the caller's line, not at jax_overlap's.
  assert record[0].filename == __file__
  with warnings.catch_warnings():
    warnings.simplefilter("error", JaxOverlapDeprecationWarning)
    assert new() == value


def test_a_setting_given_twice_is_refused():
  with pytest.raises(TypeError, match="both"):
    jax_overlap.flags.as_compiler_options("h100x8", target="h100x8")
  with pytest.raises(TypeError, match="positional"):
    jax_overlap.flags.as_compiler_options("h100x8", "fsdp", "extra")


def test_short_dtype_names_are_the_same_dtype():
  gain = jax_overlap.collective_matmul.estimate_gain
  assert gain(4096, 4096, 4096, 8, dtype="bf16", target="h100x8") == gain(
    4096, 4096, 4096, 8, dtype="bfloat16", target="h100x8"
  )


def test_every_public_name_is_there_and_jax_is_imported_on_first_use():
  # Names load on first use: the launcher, plan checks and flag syntax start without JAX,
  # and every name in __all__ (and dir()) is reachable.
  for name in jax_overlap.__all__:
    assert getattr(jax_overlap, name) is not None, name
  assert set(jax_overlap.__all__) <= set(dir(jax_overlap))
  with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
    jax_overlap.no_such_name  # noqa: B018
  with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
    jax_overlap.runtime.no_such_name  # noqa: B018
  code = (
    "import sys, jax_overlap, jax_overlap.runtime, jax_overlap.cli\n"
    "from jax_overlap._src.runtime import launch\n"
    "from jax_overlap.runtime import Plan\n"
    "Plan(kernels=[{'match': 'gemm_*', 'blocks_per_sm': 2}]).to_rules()\n"
    "print('jax' in sys.modules)\n"
    "jax_overlap.runtime.occupancy, jax_overlap.overlap\n"
    "print('jax' in sys.modules)\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["False", "True"]


def _doc_pages() -> list[pathlib.Path]:
  """Every Markdown page users read: the READMEs, docs/ and benchmarks/ (not its results)."""
  root = pathlib.Path(__file__).parents[1]
  return sorted(
    p
    for p in root.rglob("*.md")
    if not any(part.startswith(".") for part in p.relative_to(root).parts)
    and p.relative_to(root).parts[:2] != ("benchmarks", "results")
  )


def _documented_code():
  """(file, block number, code) of every Python block users read: README and docs code
  blocks, notebook cells, examples and benchmarks."""
  root = pathlib.Path(__file__).parents[1]
  for path in _doc_pages():
    found = re.finditer(r"```python\n(.*?)```", path.read_text(), re.S)
    yield from ((str(path.relative_to(root)), i, m.group(1)) for i, m in enumerate(found))
  for path in sorted((root / "notebooks").glob("*.ipynb")):
    cells = json.loads(path.read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    yield from ((path.name, i, c) for i, c in enumerate(code))
  for folder in (
    root / "jax_overlap" / "examples",
    root / "benchmarks",
    root / "benchmarks" / "gpu",
  ):
    yield from ((path.name, 0, path.read_text()) for path in sorted(folder.glob("*.py")))


def _imported_names(tree, names):
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith("jax_overlap"):
          mod = importlib.import_module(a.name)
          names[a.asname or "jax_overlap"] = mod if a.asname else jax_overlap
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax_overlap"):
      mod = importlib.import_module(node.module)
      for a in node.names:
        obj = getattr(mod, a.name, None)
        names[a.asname or a.name] = obj or importlib.import_module(f"{node.module}.{a.name}")


def _dotted(node):
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def test_docs_notebooks_and_examples_call_the_api_as_it_is_spelled_now():
  # Every call of a jax_overlap name in what users read binds to the current signature:
  # no positional target=, no retired keyword, no name the API no longer has.
  problems, checked = [], 0
  names_by_file: dict = {}
  for file, block, code in _documented_code():
    tree = ast.parse(code)
    names = names_by_file.setdefault(file, {"jax_overlap": jax_overlap})  # blocks share imports
    _imported_names(tree, names)
    for node in ast.walk(tree):
      chain = _dotted(node.func) if isinstance(node, ast.Call) else None
      if not chain or chain[0] not in names:
        continue
      where = f"{file} block {block} line {node.lineno}: {'.'.join(chain)}"
      obj = names[chain[0]]
      for attr in chain[1:]:
        obj = getattr(obj, attr, _MISSING)
        if obj is _MISSING:
          problems.append(f"{where}: no {attr!r}")
          break
      if obj is _MISSING or inspect.ismodule(obj) or not callable(obj):
        continue
      try:
        sig = inspect.signature(obj)
      except (TypeError, ValueError):
        continue
      starred = any(isinstance(a, ast.Starred) for a in node.args)
      try:
        sig.bind_partial(
          *([] if starred else [None] * len(node.args)),
          **{k.arg: None for k in node.keywords if k.arg is not None},
        )
      except TypeError as e:
        problems.append(f"{where}: {e}")
      checked += 1
  assert problems == []
  assert checked > 200  # the walk reached the README, docs, notebooks and examples
  assert {"README.md", "docs/transform.md", "docs/flags.md", "docs/analysis.md"} <= set(
    names_by_file
  )


def test_the_walk_reads_every_markdown_page():
  root = pathlib.Path(__file__).parents[1]
  pages = {str(p.relative_to(root)) for p in _doc_pages()}
  expected = {"README.md", "benchmarks/README.md", "docs/transform.md", "docs/flags.md"}
  assert expected | {"docs/analysis.md", "docs/runtime.md", "docs/budget.md"} <= pages
  assert not any(p.startswith("benchmarks/results/") for p in pages)


_MISSING = object()


@pytest.mark.parametrize(
  "record, was, key",
  [
    (jax_overlap.sim.Evaluation(True, {"gemm": 1}, 1e-3), "sim.TuneResult.table rows", "shaping"),
    (jax_overlap.analysis.LoopInfo("while.3", 3, "body.1"), "Report.loops", "trip_count"),
    (jax_overlap.analysis.MemoryStats(arguments=4096), "Report.memory", "arguments"),
    (
      jax_overlap.sim.gemm_config(jax_overlap.targets.get_gpu("h100"), 8192, 8192, 8192),
      "sim.gemm_config()",
      "grid",
    ),
    (
      jax_overlap.sim.PaperRow("h100", "fsdp", {"concurrent": 1.0}, "priority", 0.1),
      "sim.PaperTable.rows",
      "gpu",
    ),
    (
      jax_overlap.sim.CalibrationRow("priority", "gemm", None, 8, {}, {}),
      "sim.CalibrationResult.table",
      "ctas",
    ),
  ],
)
def test_records_that_were_dicts_read_as_dicts_for_one_release(record, was, key):
  name = type(record).__name__
  with pytest.warns(
    JaxOverlapDeprecationWarning,
    match=rf"{re.escape(was)}: these are {name} records now: read \.{key} instead of \['{key}'\]",
  ) as caught:
    assert record[key] == getattr(record, key)
  assert caught[0].filename == __file__
  fields = ", ".join(f.name for f in dataclasses.fields(record))
  with pytest.raises(KeyError, match=re.escape(f"{name} has {fields}, not 'no_such_key'")):
    record["no_such_key"]
  with pytest.raises(TypeError, match="not iterable"):
    iter(record)
  with pytest.raises(dataclasses.FrozenInstanceError):
    setattr(record, key, None)


# String parameters whose values are open: names of things (targets, dtypes, mesh axes,
# kernels, files) or text the function reads (HLO dumps, a policy's JSON).
OPEN_STRINGS = {
  *("target", "name", "dtype", "axis", "gpu", "policy", "thunk_text", "thunk_metadata"),
  *("hlo_text", "op_name", "launch_name", "why", "chosen", "held_by"),  # records' text and names
}


def _literal_choices(hint) -> tuple:
  """The values a ``Literal`` hint (alone or in a union) allows."""
  if typing.get_origin(hint) is typing.Literal:
    return typing.get_args(hint)
  return tuple(c for arg in typing.get_args(hint) for c in _literal_choices(arg))


def test_string_options_are_typed_as_their_choices():
  problems = []
  for full, fn in sorted({**_functions(), **_classes()}.items()):
    try:
      params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
      continue
    strings = [p for p in params if isinstance(p.default, str) and p.name not in OPEN_STRINGS]
    if not strings:
      continue
    hints = typing.get_type_hints(fn.__init__ if inspect.isclass(fn) else fn)
    for p in strings:
      hint = hints.get(p.name)
      if p.default not in _literal_choices(hint):
        problems.append(f"{full}: {p.name}={p.default!r} is typed {hint}")
  assert problems == []


_WL = jax_overlap.sim.tp_chain(2, 1024, 1024)
_SIM = jax_overlap.sim
_CM = jax_overlap.collective_matmul


@pytest.mark.parametrize(
  "owner, call, option",
  [
    (_SIM.tune, lambda **kw: _SIM.tune(_WL, target="h100", progress=False, **kw), "groups"),
    (_SIM.tune, lambda **kw: _SIM.tune(_WL, target="h100", progress=False, **kw), "method"),
    (_SIM.tune, lambda **kw: _SIM.tune(_WL, target="h100", progress=False, **kw), "baseline"),
    (_CM.estimate_gain, lambda **kw: _CM.estimate_gain(4096, 4096, 4096, 8, **kw), "kind"),
    (_CM.estimate_gain, lambda **kw: _CM.estimate_gain(4096, 4096, 4096, 8, **kw), "method"),
    (
      jax_overlap.budget.data.combine,
      lambda **kw: jax_overlap.budget.data.combine({}, **kw),
      "method",
    ),
    (jax_overlap.flags.recommended, lambda **kw: jax_overlap.flags.recommended(**kw), "workload"),
    (jax_overlap.overlap, lambda **kw: jax_overlap.overlap(lambda x: x, **kw), "gspmd"),
    (jax_overlap.overlap, lambda **kw: jax_overlap.overlap(lambda x: x, **kw), "select"),
  ],
)
def test_an_unknown_choice_is_refused_naming_the_typed_choices(owner, call, option):
  # The error names every choice of the signature's Literal: the two lists are one.
  choices = typing.get_args(typing.get_type_hints(owner)[option])
  with pytest.raises(ValueError, match="'no_such_choice'") as caught:
    call(**{option: "no_such_choice"})
  for choice in choices:
    assert repr(choice) in str(caught.value) or f" {choice}" in str(caught.value), choice
