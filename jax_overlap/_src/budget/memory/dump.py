"""Reading XLA's memory dumps (``*buffer-assignment.txt``, ``*live-range.txt``, the
optimized HLO): the values live when each temp allocation is fullest, classified by
their defining instruction (the HLO and its shapes read by the analysis' reader,
:mod:`jax_overlap._src.analysis.hlo`)."""

from __future__ import annotations

import dataclasses
import glob
import os
import re

from jax_overlap._src.analysis import hlo as hlo_lib

CATEGORIES = (
  "weights",
  "optimizer_state",
  "inputs",
  "other_arguments",
  "outputs",
  "gradients",
  "activations",
  "gathered_weights",
  "collective_buffers",
  "temporaries",
  "fragmentation",
)

_ALLOC_RE = re.compile(r"^allocation (\d+): size (\d+), (.*):\s*$")

_VALUE_RE = re.compile(
  r"^\s*value: <\d+ ([^\s>]+?)(\{[\d,]*\})?(?: @\d+)?>\s*\(size=(\d+),offset=(\d+)\): (.*)$"
)

_LIVE_RE = re.compile(r"^\s+([^\s{]+)(\{[\d,]*\}):(\d+)-(\d+)\s*$")


@dataclasses.dataclass
class _Value:
  name: str
  index: str
  size: int
  offset: int
  shape: str


def _parse_buffer_assignment(text: str) -> list[tuple[int, str, list[_Value]]]:
  allocs: list[tuple[int, str, list[_Value]]] = []
  for line in text.splitlines():
    m = _ALLOC_RE.match(line)
    if m:
      allocs.append((int(m.group(2)), m.group(3), []))
      continue
    m = _VALUE_RE.match(line)
    if m and allocs:
      allocs[-1][2].append(
        _Value(m.group(1), m.group(2) or "{}", int(m.group(3)), int(m.group(4)), m.group(5))
      )
    elif line and not line.startswith(" ") and not line.startswith("allocation") and allocs:
      break  # end of the allocation list (e.g. "Total bytes used")
  return allocs


def _is_temp(flags: str) -> bool:
  banned = ("parameter", "thread-local", "constant", "output shape", "maybe-live-out")
  return not any(b in flags for b in banned)


def _parse_live_ranges(text: str) -> dict[str, tuple[int, int]]:
  ranges = {}
  section = False
  for line in text.splitlines():
    if line.strip().startswith("BufferLiveRange"):
      section = True
      continue
    if section:
      m = _LIVE_RE.match(line)
      if m:
        ranges[m.group(1) + m.group(2)] = (int(m.group(3)), int(m.group(4)))
      elif line.strip() and not line.startswith("    "):
        section = False
  return ranges


def _parse_hlo(text: str) -> dict[str, tuple[str, str]]:
  """Instruction name -> (opcode, op_name metadata) over every computation ({} where XLA
  dumped no optimized HLO)."""
  if not text.strip():
    return {}
  module = hlo_lib.parse_module(text)
  return {
    i.name: (i.opcode, i.metadata.get("op_name", ""))
    for comp in module.computations.values()
    for i in comp.instructions
  }


def _dims(shape: str) -> tuple[str, tuple[int, ...]] | None:
  """(dtype, dims) of an array shape; None for a tuple."""
  arrays = hlo_lib.array_shapes(shape)
  return arrays[0] if len(arrays) == 1 and not shape.lstrip().startswith("(") else None


_COLLECTIVES = (
  "all-gather",
  "reduce-scatter",
  "all-reduce",
  "all-to-all",
  "collective-permute",
  "ragged-all-to-all",
  "collective-broadcast",
)


def _classify(value: _Value, hlo: dict[str, tuple[str, str]], weight_shapes: set) -> str:
  opcode, opname = hlo.get(value.name, ("", ""))
  base = opcode or value.name
  dims = _dims(value.shape)
  weight_like = dims is not None and dims[1] in weight_shapes
  if base.startswith("all-gather"):
    return "gathered_weights"
  if base.startswith(_COLLECTIVES) or (opcode.startswith("async") and "all-" in value.name):
    return (
      "gradients"
      if weight_like and base.startswith(("reduce-scatter", "all-reduce"))
      else ("collective_buffers")
    )
  if "transpose(" in opname:
    return "gradients" if weight_like else "temporaries"
  if "jvp(" in opname:
    return "activations"
  return "temporaries"


def _covered(values: list[_Value]) -> int:
  """Bytes covered by the union of the values' [offset, offset + size) ranges."""
  total, end = 0, -1
  for v in sorted(values, key=lambda v: v.offset):
    lo, hi = max(v.offset, end), v.offset + v.size
    if hi > lo:
      total += hi - lo
    end = max(end, hi)
  return total


def _attribute_temp(
  allocs: list[tuple[int, str, list[_Value]]],
  ranges: dict[str, tuple[int, int]],
  hlo: dict[str, tuple[str, str]],
  weight_shapes: set,
) -> tuple[dict[str, int], list[tuple[str, str, int]], int]:
  """Temp bytes by category at each temp allocation's fullest moment; returns (cats, values, sum)."""
  cats = {c: 0 for c in CATEGORIES}
  peak_values: list[tuple[str, str, int]] = []
  total = 0
  for size, flags, values in allocs:
    if not _is_temp(flags):
      continue
    total += size
    timed = [(v, ranges.get(v.name + v.index)) for v in values]
    events = sorted({r[0] for _, r in timed if r is not None})
    best_t, best = None, -1
    for t in events:
      live = _covered([v for v, r in timed if r is not None and r[0] <= t <= r[1]])
      if live > best:
        best_t, best = t, live
    if best_t is None:
      # No live ranges (e.g. a single-value allocation): the largest value stands for it.
      chosen = [max(values, key=lambda v: v.size)] if values else []
    else:
      chosen = [v for v, r in timed if r is not None and r[0] <= best_t <= r[1]]
    used = 0
    # Values that share bytes at that moment (an in-place op's input and output)
    # count once: each byte goes to the first value covering it.
    end = -1
    for v in sorted(chosen, key=lambda v: (v.offset, -v.size)):
      nbytes = min(v.offset + v.size - max(end, v.offset), size - used)
      end = max(end, v.offset + v.size)
      if nbytes <= 0:
        continue
      cat = _classify(v, hlo, weight_shapes)
      cats[cat] += nbytes
      used += nbytes
      peak_values.append((v.name + (v.index if v.index != "{}" else ""), cat, nbytes))
    cats["fragmentation"] += size - used
  peak_values.sort(key=lambda x: -x[2])
  return cats, peak_values, total


def _read_dump(directory: str, suffix: str) -> str:
  files = sorted(glob.glob(os.path.join(directory, f"*after_optimizations{suffix}")))
  if not files:
    return ""
  # One module per compile; the newest module number is the step.
  with open(files[-1]) as f:
    return f.read()
