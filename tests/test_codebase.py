"""The codebase keeps its modules a size a reader takes in: one over 500 lines says why at
its top, in the words "(Over 500 lines: <reason>)"."""

import ast
import pathlib
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIMIT = 500
PATTERNS = (
  "jax_overlap/**/*.py",
  "xla_patches/**/*.c",
  "xla_patches/**/*.cc",
  "xla_patches/**/*.h",
)


def _says_why(lines: list[str]) -> bool:
  return "(Over 500 lines:" in " ".join(line.strip(" */#") for line in lines[:20])


def test_a_long_module_says_why_at_its_top():
  sources = sorted(p for pattern in PATTERNS for p in ROOT.glob(pattern))
  assert {"decorator.py", "hlo.py", "hooks.cc", "fake_cuda.c"} <= {p.name for p in sources}
  long = {p: p.read_text().splitlines() for p in sources}
  long = {p: lines for p, lines in long.items() if len(lines) > LIMIT}
  assert long, "no module over the limit: the check reads nothing"
  silent = [
    f"{p.relative_to(ROOT)} ({len(lines)} lines)"
    for p, lines in long.items()
    if not _says_why(lines)
  ]
  assert not silent, (
    f"split these, or say at the top of each why it is one module, as '(Over 500 lines: "
    f"<reason>)': {silent}"
  )


def test_the_check_reads_a_reason_where_it_is_written():
  assert _says_why(['"""The registry (data).', "", "(Over 500 lines: entries.)", '"""'])
  assert _says_why(["/* A fake libcuda.", " *", " * (Over 500 lines: one fake per entry", " */"])
  assert not _says_why(['"""A module."""'] + ["x = 1"] * 30 + ["# (Over 500 lines: too late)"])


# The stages of the data flow, one package each under jax_overlap/_src, and the modules
# every stage shares (the GPU catalogue, errors, where files go).
STAGES = {
  "transform",
  "collective_matmul",
  "fsdp",
  "flags",
  "compile",
  "analysis",
  "sim",
  "budget",
  "runtime",
}
# framework_jits: nnx.jit and filter_jit steps, read by the transform and compiles alike.
SHARED = {"targets", "errors", "deprecations", "cache", "lazy_names", "framework_jits"}
SRC = ROOT / "jax_overlap" / "_src"


def _stage(module: str) -> str | None:
  """The stage package (or shared module) of a dotted name under jax_overlap._src."""
  parts = module.split(".")
  return parts[2] if parts[:2] == ["jax_overlap", "_src"] and len(parts) > 2 else None


def _private_crossings(
  path: pathlib.Path, root: pathlib.Path = ROOT, unit: Callable[[str], str | None] = None
) -> list[str]:
  """Private names ``path`` (under ``root``) takes from another stage: ``from <stage>
  import _name``, or ``mod._name`` on a module imported from another stage. ``unit``: what
  a private name stays inside (by default the stage; ``str``: the module itself)."""
  unit = unit or _stage
  module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
  here = unit(module)
  tree = ast.parse(path.read_text())
  out, modules = [], {}
  for node in ast.walk(tree):
    if not (
      isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax_overlap._src")
    ):
      continue
    for alias in node.names:
      full = f"{node.module}.{alias.name}"
      as_path = root / full.replace(".", "/")
      if as_path.with_suffix(".py").exists() or as_path.is_dir():
        modules[alias.asname or alias.name] = full
      elif alias.name.startswith("_") and unit(node.module) != here:
        out.append(f"{path.name}:{node.lineno} from {node.module} import {alias.name}")
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Attribute)
      and isinstance(node.value, ast.Name)
      and node.value.id in modules
      and node.attr.startswith("_")
      and not node.attr.startswith("__")
      and unit(modules[node.value.id]) != here
    ):
      out.append(f"{path.name}:{node.lineno} {modules[node.value.id]}.{node.attr}")
  return out


def test_src_is_one_package_per_stage():
  loose = {p.stem for p in SRC.glob("*.py")} - {"__init__"}
  packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
  assert loose == SHARED, f"modules of _src outside a stage package: {loose - SHARED}"
  assert packages == STAGES, f"stage packages {packages ^ STAGES} differ from the data flow's"
  # Each package says at its top what its modules do.
  for name in packages:
    assert ast.get_docstring(ast.parse((SRC / name / "__init__.py").read_text())), name


def test_no_stage_takes_another_stages_private_names():
  sources = sorted(SRC.rglob("*.py"))
  assert len(sources) > 60
  crossings = [c for p in sources for c in _private_crossings(p)]
  assert not crossings, f"private names used across stages (make them public there): {crossings}"


def test_transform_modules_and_their_tests_keep_private_names_inside_their_module():
  # The transform's steps (and the collective matmuls it builds) pass typed records and
  # public functions between modules; tests read those, never a module's private names.
  sources = sorted((SRC / "transform").rglob("*.py")) + sorted(
    (SRC / "collective_matmul").rglob("*.py")
  )
  sources += sorted((ROOT / "tests").glob("test_*.py"))
  transform_pkgs = ("jax_overlap._src.transform", "jax_overlap._src.collective_matmul")

  def module_unit(module: str) -> str | None:
    return module if module.startswith(transform_pkgs) else None

  crossings = [c for p in sources for c in _private_crossings(p, ROOT, module_unit)]
  assert not crossings, f"private names used across modules (make them public there): {crossings}"


def test_the_module_check_finds_a_crossing(tmp_path):
  pkg = tmp_path / "jax_overlap" / "_src" / "transform"
  pkg.mkdir(parents=True)
  (pkg / "jaxprs.py").write_text("")
  src = pkg / "planning.py"
  src.write_text(
    "from jax_overlap._src.transform import jaxprs\n"
    "from jax_overlap._src.transform.jaxprs import _is_var, is_var\n"
    "jaxprs._producers\n"
  )
  assert _private_crossings(src, tmp_path, str) == [
    "planning.py:2 from jax_overlap._src.transform.jaxprs import _is_var",
    "planning.py:3 jax_overlap._src.transform.jaxprs._producers",
  ]


def test_the_stage_check_finds_a_crossing(tmp_path):
  mod = tmp_path / "jax_overlap" / "_src" / "sim"
  mod.mkdir(parents=True)
  (tmp_path / "jax_overlap" / "_src" / "analysis").mkdir()
  (tmp_path / "jax_overlap" / "_src" / "analysis" / "hlo.py").write_text("")
  src = mod / "x.py"
  src.write_text(
    "from jax_overlap._src.analysis import hlo\n"
    "from jax_overlap._src.analysis.hlo import _split_top\n"
    "from jax_overlap._src.sim import _same_stage\n"
    "hlo._parse_instruction\n"
  )
  assert _private_crossings(src, tmp_path) == [
    "x.py:2 from jax_overlap._src.analysis.hlo import _split_top",
    "x.py:4 jax_overlap._src.analysis.hlo._parse_instruction",
  ]
