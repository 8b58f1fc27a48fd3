"""The codebase keeps its modules a size a reader takes in: one over 500 lines says why at
its top, in the words "(Over 500 lines: <reason>)"."""

import pathlib

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
