"""Figures quoted in the README and the docs match the results files they come from.

A quoted figure carries a marker right after it, an HTML comment that renders as nothing:

  43.634 ms<!-- fig benchmarks/results/analysis_fsdp.md | h100x8, unrolled | recommended flags | step ms -->
    a cell of a Markdown table: the row whose cells (or the table's heading) equal every
    key, the column named last; ``column[i]`` takes the i-th number of a cell such as
    "27.91 / 34.45";
  8.534<!-- fig benchmarks/results/transform_tp.md ~ a100x8 shard_map medium: .*?the analysis ([\\d.]+) ms -->
    the group of a regular expression that matches the file once (within a line);
  6<!-- fig benchmarks/results/transform_fsdp.md # \\(chosen\\) -->
    the number of the expression's matches.

The figure is the last number before the marker; the file's value, rounded half-up to the
figure's decimals, must equal it. Figures derived from several results (counts across a
table, percentages, a whole table) are computed below from the same files.
"""

from __future__ import annotations

import decimal
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [
  ROOT / "README.md",
  *sorted((ROOT / "docs").glob("*.md")),
  ROOT / "benchmarks" / "README.md",
]
_MARKER = re.compile(r"<!-- fig (\S+) ([|~#]) (.*?) -->", re.S)
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _markers():
  for doc in DOCS:
    text = doc.read_text()
    for m in _MARKER.finditer(text):
      before = re.sub(r"<!--.*?-->", "", text[: m.start()], flags=re.S)
      line = text.count("\n", 0, m.start()) + 1
      yield pytest.param(
        doc, before, m.group(1), m.group(2), m.group(3), id=f"{doc.relative_to(ROOT)}:{line}"
      )


def _tables(text: str):
  """(heading, header, rows) of every Markdown table, rows as lists of cells."""
  heading, lines = "", text.splitlines()
  for i, line in enumerate(lines):
    if line.startswith("#"):
      heading = line.lstrip("#").strip()
    elif (
      line.startswith("|")
      and i + 1 < len(lines)
      and re.match(r"\|\s*:?-+", lines[i + 1])
      and not (i and lines[i - 1].startswith("|"))
    ):
      header = [c.strip() for c in line.strip().strip("|").split("|")]
      rows = []
      for row in lines[i + 2 :]:
        if not row.startswith("|"):
          break
        rows.append([c.strip() for c in row.strip().strip("|").split("|")])
      yield heading, header, rows


def _cell(text: str, spec: str) -> str:
  *keys, column = [k.strip() for k in spec.split(" | ")]
  index = None
  if m := re.fullmatch(r"(.*)\[(\d+)\]", column):
    column, index = m.group(1), int(m.group(2))
  found = [
    row[header.index(column)]
    for heading, header, rows in _tables(text)
    if column in header
    for row in rows
    if all(k in row or k == heading for k in keys)
  ]
  assert len(found) == 1, f"{len(found)} rows match {keys} with a column {column!r}"
  numbers = _NUMBER.findall(found[0])
  if index is None:
    assert len(numbers) == 1, f"cell {found[0]!r} holds {len(numbers)} numbers: say which"
    return numbers[0]
  return numbers[index]


def _source_value(path: str, kind: str, spec: str) -> str:
  text = (ROOT / path).read_text()
  if kind == "|":
    return _cell(text, spec)
  if kind == "#":
    return str(len(re.findall(spec, text)))
  matches = [m.group(1) for m in re.finditer(spec, text)]
  assert len(matches) == 1, f"{spec!r} matches {path} {len(matches)} times, not once"
  return matches[0]


def _rounded(value: str, like: str) -> str:
  places = len(like.split(".")[1]) if "." in like else 0
  q = decimal.Decimal(1).scaleb(-places)
  return str(decimal.Decimal(value).quantize(q, rounding=decimal.ROUND_HALF_UP))


@pytest.mark.parametrize("doc, before, path, kind, spec", list(_markers()))
def test_a_marked_figure_is_the_one_in_its_results_file(doc, before, path, kind, spec):
  assert (ROOT / path).is_file(), f"{path} does not exist"
  quoted = _NUMBER.findall(before)[-1]
  assert _rounded(_source_value(path, kind, spec), quoted) == quoted, (
    f"{doc.relative_to(ROOT)} quotes {quoted}, {path} has {_source_value(path, kind, spec)}"
  )


def test_the_readme_marks_its_headline_figures():
  # "Results at a glance" quotes nothing unmarked: every number with a unit or a % there
  # carries a marker (years, GPU counts and sizes in names are not figures).
  readme = (ROOT / "README.md").read_text()
  glance = readme.split("## Results at a glance")[1].split("\n## ")[0]
  unmarked = re.findall(r"\d+(?:\.\d+)? ?(?:ms|us|%)(?!<!-- fig)", glance)
  assert unmarked == []
  assert len(_MARKER.findall(glance)) >= 20


# ---------------------------------------------------------------------------
# Figures derived from several results.
# ---------------------------------------------------------------------------


def _flat(path: pathlib.Path) -> str:
  return re.sub(r"\s+", " ", re.sub(r"<!--.*?-->", "", path.read_text(), flags=re.S))


def _tp_rows():
  text = (ROOT / "benchmarks/results/transform_tp.md").read_text()
  (_, header, rows), *_ = list(_tables(text))
  return [dict(zip(header, r)) for r in rows]


_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}


def test_reserved_sms_against_priority_alone_in_runtime_doc():
  # Every TP row's 8- and 24-SM reservations against XLA's priority alone.
  faster, total = [], 0
  for row in _tp_rows():
    alone = float(row["sim: XLA priority ms"])
    for reserved in _NUMBER.findall(row["sim: XLA priority, 8 / 24 SMs reserved ms"]):
      total += 1
      if float(reserved) < alone:
        faster.append((alone - float(reserved)) / alone * 100)
        assert "rings" in row["variant"]
  expected = (
    f"slower than XLA's priority alone in all but {_WORDS[len(faster)]} of the {total} "
    f"cases, and faster by at most {max(faster):.1f}% in those (the ring rows)"
  )
  assert expected in _flat(ROOT / "docs" / "runtime.md")


def test_the_two_models_disagree_at_hidden_4096_on_a100():
  note = next(
    ln
    for ln in (ROOT / "benchmarks/results/transform_tp.md").read_text().splitlines()
    if ln.startswith("- a100x8 shard_map medium:")
  )
  chosen, sim_chosen = map(
    float,
    re.search(
      r"the analysis ([\d.]+) ms, sim.realize \(SM contention, XLA's stream priority\) ([\d.]+)",
      note,
    ).groups(),
  )
  written, sim_written = map(
    float,
    re.search(r"step as written .*?the analysis ([\d.]+) ms, sim.realize ([\d.]+)", note).groups(),
  )
  faster = (written - chosen) / written * 100
  slower = (sim_chosen - sim_written) / sim_written * 100
  expected = f"the analysis picks a rewrite {faster:.0f}% faster"
  assert expected in _flat(ROOT / "docs" / "transform.md")
  assert f"the simulator has it {slower:.1f}% slower" in _flat(ROOT / "docs" / "transform.md")
  assert "the two models disagree" in note


def _fsdp_rows():
  rows = json.loads((ROOT / "benchmarks/results/transform_fsdp.json").read_text())["rows"]
  by: dict = {}
  for r in rows:
    by.setdefault((r["target"], r["form"]), {})[r["name"]] = r
  return by


_FORMS = {
  "unrolled": "unrolled",
  "scan": "`lax.scan`",
  "scan_remat": "`lax.scan` + `jax.checkpoint`",
  "scan_layers": "`scan_layers`",
  "gspmd": "GSPMD, unrolled",
  "gspmd_scan_remat": "GSPMD, `lax.scan` + `jax.checkpoint`",
  "llama_per_use": "Llama, gathered at each use",
  "llama_per_layer": "Llama, gathered per layer",
  "llama_scan_remat": "Llama, `lax.scan` + `jax.checkpoint`",
  "llama_gspmd": "Llama, GSPMD",
  "flax": "Flax + optax",
  "gspmd_2d": "GSPMD on 2-D, `lax.scan` + `jax.checkpoint`",
  "flax_llama_2d": "Flax Llama on 2-D, `nn.scan(nn.remat)`",
  "nnx_llama_2d": "Flax NNX Llama on 2-D, `nnx.scan(nnx.remat)`",
  "explicit_llama_2d": "Explicit-axes Llama on 2-D, `lax.scan` + `jax.checkpoint`",
}


def test_the_fsdp_table_is_the_results_file():
  # benchmarks/README.md's table, row for row, from transform_fsdp.json.
  text = (ROOT / "benchmarks" / "README.md").read_text()
  table = next(rows for _, header, rows in _tables(text) if "recommended flags" in header)
  expected = []
  rows = _fsdp_rows()
  order = sorted(rows, key=lambda k: (["h100x8", "a100x8"].index(k[0]), list(_FORMS).index(k[1])))
  for target, form in order:
    v = rows[(target, form)]
    cells = [
      f"{v[n]['exposed_fraction'] * 100:.1f} %, {v[n]['vs_compute_bound']:.3f}"
      for n in ("XLA defaults", "recommended flags", "@overlap")
    ]
    sim = " / ".join(
      f"{v[n]['realize_priority_s'] * 1e3:.1f}"
      for n in ("XLA defaults", "recommended flags", "@overlap")
    )
    notes = ", ".join(
      n
      for n, on in (
        ("self-judged", v["@overlap"]["self_judged"]),
        ("shard_map form", v["@overlap"]["chosen"].startswith("shard_map form")),
      )
      if on
    )
    expected.append([target, _FORMS[form], *cells, sim, notes])
  assert table == expected


def test_fsdp_prose_figures():
  flat = _flat(ROOT / "benchmarks" / "README.md")
  by = _fsdp_rows()
  for target in ("h100x8", "a100x8"):
    gains = [
      (v["recommended flags"]["realize_priority_s"] - v["@overlap"]["realize_priority_s"])
      / v["recommended flags"]["realize_priority_s"]
      * 100
      for (t, _), v in by.items()
      if t == target
    ]
    assert f"{min(gains):.1f}-{max(gains):.1f}% on {target}" in flat
  times = [v["@overlap"]["selection_time_s"] for v in by.values()]
  assert f"took {min(times):.0f}-{max(times):.0f} s per form" in flat
  as_written = [k for k, v in by.items() if "as written" in v["@overlap"]["chosen"]]
  assert sorted({f for _, f in as_written}) == [
    "explicit_llama_2d",
    "flax_llama_2d",
    "gspmd",
    "gspmd_2d",
    "gspmd_scan_remat",
    "llama_gspmd",
    "llama_scan_remat",
    "nnx_llama_2d",
    "scan",
    "scan_remat",
    "unrolled",
  ]
  assert len(as_written) == 15


def _slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_between_pages_resolve(doc):
  # The README points into docs/ and benchmarks/ by file and section: moved text stays found.
  broken = []
  for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
    if re.match(r"[a-z]+:", target):
      continue
    path, _, anchor = target.partition("#")
    page = (doc.parent / path).resolve() if path else doc
    if not page.exists():
      broken.append(target)
    elif anchor and page.suffix == ".md":
      headings = re.findall(r"^#+ (.*)$", page.read_text(), re.M)
      if anchor not in {_slug(h) for h in headings}:
        broken.append(target)
  assert broken == []


def test_two_sequences_per_gpu():
  rows = json.loads((ROOT / "benchmarks/results/transform_fsdp_b2.json").read_text())["rows"]
  chosen = [r for r in rows if r["name"] == "@overlap"]
  assert len(chosen) == 22  # eleven forms on two GPUs
  six = [r for r in chosen if not r["form"].startswith(("llama", "flax"))]
  rest = [r for r in chosen if r not in six]
  assert len(six) == 12

  def span(rs):
    exposed = [r["exposed_fraction"] * 100 for r in rs]
    return (
      f"{min(exposed):.1f}-{max(exposed):.1f}%",
      f"{max(r['vs_compute_bound'] for r in rs):.3f}x",
    )

  (e6, b6), (er, br) = span(six), span(rest)
  expected = (
    f"leaves {e6} of the communication exposed in the six shard_map and GSPMD forms on both "
    f"GPUs, each step within {b6} of its compute, and {er} in the Llama and Flax forms "
    f"(within {br})"
  )
  assert expected in _flat(ROOT / "benchmarks" / "README.md")


def test_the_flag_corpus_size():
  corpus = json.loads((ROOT / "tests/data/xla_flags_corpus.json").read_text())
  assert f"on a corpus of {len(corpus['entries'])} strings" in _flat(ROOT / "docs" / "flags.md")


def test_the_cost_model_table_in_runtime_doc():
  # docs/runtime.md's table of the cost model against the H200, from the two results files
  # it names (command buffers on: the second run; off: the nocb run).
  def rows(name):
    text = (ROOT / "benchmarks/results" / name).read_text()
    (_, header, table), *_ = list(_tables(text))
    return {r[0]: dict(zip(header, r)) for r in table}

  on = rows("model_check_nvidia_h200_2026-12-04_2.md")
  off = rows("model_check_nocb_nvidia_h200_2026-12-04.md")
  doc = (ROOT / "docs" / "runtime.md").read_text()
  (_, _, table), *_ = [t for t in _tables(doc) if "estimated (ms)" in t[1]]
  est, meas, ratio = (
    "estimated compute, same compile (ms)",
    "measured kernels (ms)",
    "estimate / measured",
  )
  for (program, *cells), size in zip(table, ("large", "medium", "large+scan_remat")):
    assert cells == [
      _rounded(on[size][est], "0.00"),
      f"{_rounded(on[size][meas], '0.00')} / {_rounded(off[size][meas], '0.00')}",
      f"{on[size][ratio]} / {off[size][ratio]}",
    ], program
