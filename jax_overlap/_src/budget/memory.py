"""Memory budgets: what one training step holds per device, and a planner that fits a budget.

:func:`breakdown` compiles a step (deviceless for GPU targets) and splits XLA's
own per-device total,

    total = argument bytes + output bytes + temp bytes - alias bytes

(``Compiled.memory_analysis()``), into categories that sum to it exactly:

* arguments, from the argument pytrees and their shardings (bytes of each
  leaf's shard): ``weights``, ``optimizer_state``, ``inputs``;
  ``other_arguments`` holds any difference to XLA's argument bytes (arguments
  that ``jit`` pruned are negative there);
* ``outputs``: output bytes that do not reuse a donated argument;
* the temp buffer, from the compiler's buffer assignment and live ranges
  (``xla_dump_to``: ``*buffer-assignment.txt``, ``*live-range.txt`` and the
  optimized HLO): for each temp allocation, the values live at the moment the
  allocation is fullest are classified by their defining instruction:
  ``gathered_weights`` (all-gather results: the prefetch buffers overlap
  needs), ``gradients`` (backward values and reduce-scatter/all-reduce
  results shaped like a weight), ``collective_buffers`` (other collective
  results), ``activations`` (forward values still live: saved residuals and
  the forward's working set), ``temporaries`` (everything else), and
  ``fragmentation`` (allocation bytes no value occupies at that moment).

:func:`plan` searches remat policy x optimizer-state sharding x prefetch depth
through a user step builder, compiles each candidate, keeps those within the
budget and ranks them by estimated step time, returning the whole table.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
from absl import logging

from jax_overlap._src import deprecations, errors

__all__ = [
  "CATEGORIES",
  "Breakdown",
  "Candidate",
  "Plan",
  "PlanRow",
  "breakdown",
  "plan",
  "remat_policy",
]

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

_OPT_KEYS = ("opt", "optim", "mu", "nu", "momentum", "adam", "velocity", "moment", "count")
_KINDS = ("weights", "optimizer_state", "inputs")


def _fmt_bytes(n: float) -> str:
  sign = "-" if n < 0 else ""
  n = abs(float(n))
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
    n /= 1024
  return f"{sign}{n:.2f} TiB"


@dataclasses.dataclass(frozen=True)
class Breakdown:
  """Per-device memory of one compiled step, by category.

  Attributes:
    target: the platform or target name the step compiled for.
    categories: bytes per category (keys of :data:`CATEGORIES`, in order);
      they sum to :attr:`total_bytes`.
    argument_bytes: XLA's argument bytes.
    output_bytes: XLA's output bytes.
    temp_bytes: XLA's temp bytes.
    alias_bytes: XLA's bytes of outputs that reuse donated arguments.
    arguments: ``(path, kind, bytes)`` for every argument leaf.
    peak_values: ``(value, category, bytes)`` of the temp values live at the
      temp allocations' fullest moment, largest first.
    unattributed_temp_bytes: temp bytes the compiler's dump did not account
      for (counted under ``temporaries``); 0 when the dump covers XLA's temp.
    hlo_text: the optimized HLO the numbers come from.
  """

  target: str
  categories: dict[str, int]
  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  arguments: tuple[tuple[str, str, int], ...] = ()
  peak_values: tuple[tuple[str, str, int], ...] = ()
  unattributed_temp_bytes: int = 0
  hlo_text: str = dataclasses.field(default="", repr=False, compare=False)

  @property
  def total_bytes(self) -> int:
    """``argument + output + temp - alias`` bytes, per device."""
    return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

  def __getitem__(self, category: str) -> int:
    if category not in self.categories:
      raise KeyError(f"Breakdown: unknown category {category!r}; have {list(self.categories)}")
    return self.categories[category]

  def __str__(self) -> str:
    total = self.total_bytes or 1
    lines = [f"memory per device on {self.target}: {_fmt_bytes(self.total_bytes)}"]
    for name, value in self.categories.items():
      if value:
        lines.append(f"  {name:<20} {_fmt_bytes(value):>12}  {100 * value / total:5.1f}%")
    lines.append(
      f"  (XLA: arguments {_fmt_bytes(self.argument_bytes)} + outputs "
      f"{_fmt_bytes(self.output_bytes)} + temp {_fmt_bytes(self.temp_bytes)} - aliased "
      f"{_fmt_bytes(self.alias_bytes)})"
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- arguments


def _leaf_bytes(leaf: Any) -> tuple[int, tuple[int, ...], tuple[int, ...], str]:
  """(bytes of one device's shard, shard shape, global shape, dtype name) of an argument leaf."""
  shape = tuple(getattr(leaf, "shape", ()))
  dtype = jax.numpy.dtype(getattr(leaf, "dtype", jax.numpy.result_type(leaf)))
  sharding = getattr(leaf, "sharding", None)
  shard = tuple(sharding.shard_shape(shape)) if sharding is not None else shape
  return math.prod(shard) * dtype.itemsize, shard, shape, dtype.name


def _default_kind(position: int, nargs: int, path: str) -> str:
  lowered = path.lower()
  tokens = set(re.findall(r"[a-z]+", lowered))
  if tokens & set(_OPT_KEYS):
    return "optimizer_state"
  if position == 0:
    return "weights"
  if position == 1 and nargs >= 3:
    return "optimizer_state"
  return "inputs"


def _place_on_target(args: Sequence[Any], target: str | None) -> list[Any]:
  """Gives leaves without a sharding one compile-only device of ``target``."""
  if target is None:
    return list(args)
  from jax_overlap._src import targets as _targets

  device = None

  def place(x):
    nonlocal device
    if getattr(x, "sharding", None) is not None or not hasattr(x, "shape"):
      return x
    if device is None:
      device = _targets.compile_only_devices(target)[0]
    return jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(device)
    )

  return [jax.tree_util.tree_map(place, a) for a in args]


# ----------------------------------------------------------------------------- dump parsing

_ALLOC_RE = re.compile(r"^allocation (\d+): size (\d+), (.*):\s*$")
_VALUE_RE = re.compile(
  r"^\s*value: <\d+ ([^\s>]+?)(\{[\d,]*\})?(?: @\d+)?>\s*\(size=(\d+),offset=(\d+)\): (.*)$"
)
_LIVE_RE = re.compile(r"^\s+([^\s{]+)(\{[\d,]*\}):(\d+)-(\d+)\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE_RE = re.compile(r"[\s)\]}]([a-z][a-z0-9\-_]*)\(")
_SHAPE_RE = re.compile(r"^([a-z]+\d*)\[([\d,]*)\]")


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
  """Instruction name -> (opcode, op_name metadata) over every computation."""
  out = {}
  for line in text.splitlines():
    m = _INSTR_RE.match(line)
    if not m or line.lstrip().startswith(("HloModule", "//")):
      continue
    rest = m.group(2)
    op = _OPCODE_RE.search(" " + rest)
    opname = re.search(r'op_name="([^"]*)"', rest)
    out[m.group(1)] = (op.group(1) if op else "", opname.group(1) if opname else "")
  return out


def _dims(shape: str) -> tuple[str, tuple[int, ...]] | None:
  m = _SHAPE_RE.match(shape.strip())
  if not m:
    return None
  dims = tuple(int(d) for d in m.group(2).split(",") if d)
  return m.group(1), dims


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


# ----------------------------------------------------------------------------- breakdown


@deprecations.renamed(
  {"compiler_options": "xla_options"}, api="jax_overlap.budget.memory.breakdown"
)
def breakdown(
  fn: Callable[..., Any],
  *args: Any,
  target: str | None = None,
  arg_kinds: Sequence[str | None] | None = None,
  donate_argnums: int | Sequence[int] = (),
  xla_options: dict[str, Any] | None = None,
) -> Breakdown:
  """Per-device memory of one step by category, summing exactly to XLA's total.

  Args:
    fn: the step function, jitted or not; a plain function is jitted with
      ``keep_unused=True`` and ``donate_argnums``.
    *args: its arguments: arrays or ``jax.ShapeDtypeStruct`` with shardings
      (e.g. on :func:`jax_overlap.targets.compile_only_mesh`), so GPU targets
      compile deviceless.
    target: a GPU target such as ``"h100x8"``; leaves without a sharding are
      put on its first compile-only device. Default: where the shardings say.
    arg_kinds: one of ``"weights"``, ``"optimizer_state"``, ``"inputs"`` (or
      None for the default) per positional argument. Default: argument 0 is
      weights; argument 1 is optimizer state when there are three or more;
      leaves whose path names optimizer state (``opt``, ``mu``, ``nu``,
      ``momentum``...) are optimizer state; the rest are inputs.
    donate_argnums: donated arguments, for a plain ``fn``.
    xla_options: extra XLA options for this compile.

  Returns:
    A :class:`Breakdown` whose categories sum to ``total_bytes``.

  Raises:
    ValueError: for a bad ``arg_kinds``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> step = lambda w, x: (w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w))
    >>> b = breakdown(step, jnp.ones((64, 64)), jnp.ones((8, 64)))
    >>> sum(b.categories.values()) == b.total_bytes
    True
  """
  if arg_kinds is not None:
    if len(arg_kinds) != len(args):
      raise ValueError(
        f"budget.memory.breakdown: arg_kinds needs one entry per argument ({len(args)}), "
        f"got {len(arg_kinds)}"
      )
    bad = [k for k in arg_kinds if k is not None and k not in _KINDS]
    if bad:
      raise ValueError(
        f"budget.memory.breakdown: arg_kinds entries must be one of {_KINDS} or None, got {bad}"
      )
  args = _place_on_target(args, target)
  jitted = (
    fn if hasattr(fn, "lower") else jax.jit(fn, donate_argnums=donate_argnums, keep_unused=True)
  )
  options = dict(xla_options or {})
  with tempfile.TemporaryDirectory(prefix="jax_overlap_mem_") as tmp:
    options["xla_dump_to"] = tmp
    traced = errors.trace_user_fn(
      "budget.memory.breakdown", fn, tuple(args), {}, lambda: jitted.trace(*args)
    )
    compiled = traced.lower().compile(options)
    assignment = _read_dump(tmp, "-buffer-assignment.txt")
    live = _read_dump(tmp, "-live-range.txt")
    hlo_files = [
      f
      for f in glob.glob(os.path.join(tmp, "*after_optimizations.txt"))
      if "buffer-assignment" not in f
    ]
    hlo_text = open(sorted(hlo_files)[-1]).read() if hlo_files else ""
  mem = compiled.memory_analysis()
  if isinstance(mem, (list, tuple)):
    mem = mem[0]
  arg_b, out_b = int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes)
  tmp_b, alias_b = int(mem.temp_size_in_bytes), int(mem.alias_size_in_bytes)

  cats = {c: 0 for c in CATEGORIES}
  arguments = []
  weight_shapes: set = set()
  for position, arg in enumerate(args):
    for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
      pstr = f"[{position}]" + jax.tree_util.keystr(path)
      kind = (arg_kinds[position] if arg_kinds is not None else None) or _default_kind(
        position, len(args), pstr
      )
      nbytes, shard, shape, _ = _leaf_bytes(leaf)
      cats[kind] += nbytes
      arguments.append((pstr, kind, nbytes))
      if kind == "weights":
        for s in (shard, shape):
          weight_shapes.add(s)
          if len(s) > 1:
            weight_shapes.add(s[1:])  # one layer of stacked weights
  cats["other_arguments"] = arg_b - sum(cats[k] for k in _KINDS)
  cats["outputs"] = out_b - alias_b

  temp_cats, peak_values, parsed = _attribute_temp(
    _parse_buffer_assignment(assignment),
    _parse_live_ranges(live),
    _parse_hlo(hlo_text),
    weight_shapes,
  )
  if parsed == 0 and tmp_b:
    temp_cats = {c: 0 for c in CATEGORIES}
    temp_cats["temporaries"] = tmp_b
    logging.warning("budget.memory.breakdown: no buffer assignment dump; temp bytes unattributed")
  elif parsed != tmp_b:
    # The dump and the analysis disagree (e.g. scratch XLA adds after assignment):
    # the difference stays visible as temporaries.
    temp_cats["temporaries"] += tmp_b - parsed
  for c, v in temp_cats.items():
    cats[c] += v
  name = target
  if name is None:
    leaves = [
      x for x in jax.tree_util.tree_leaves(args) if getattr(x, "sharding", None) is not None
    ]
    name = next(iter(leaves[0].sharding.device_set)).platform if leaves else jax.default_backend()
  return Breakdown(
    target=str(name),
    categories=cats,
    argument_bytes=arg_b,
    output_bytes=out_b,
    temp_bytes=tmp_b,
    alias_bytes=alias_b,
    arguments=tuple(arguments),
    peak_values=tuple(peak_values),
    unattributed_temp_bytes=tmp_b - parsed if parsed else tmp_b,
    hlo_text=hlo_text,
  )


# ----------------------------------------------------------------------------- plan

_POLICY_ALIASES = {
  "nothing": "nothing_saveable",
  "dots": "dots_saveable",
  "dots_no_batch": "dots_with_no_batch_dims_saveable",
  "everything": "everything_saveable",
}


def remat_policy(name: str) -> Callable[..., Any]:
  """A ``jax.checkpoint_policies`` policy by name.

  Args:
    name: ``"nothing"``, ``"dots"``, ``"dots_no_batch"``, ``"everything"``, any
      attribute name of ``jax.checkpoint_policies`` (e.g. ``"nothing_saveable"``),
      or ``"names:a,b"`` for ``save_only_these_names("a", "b")`` (values tagged
      with ``jax.ad_checkpoint.checkpoint_name``).

  Returns:
    The policy callable for ``jax.checkpoint(..., policy=...)``.

  Raises:
    ValueError: for an unknown name.

  Example:
    >>> import jax
    >>> remat_policy("dots") is jax.checkpoint_policies.dots_saveable
    True
  """
  policies = jax.checkpoint_policies
  if not isinstance(name, str):
    raise TypeError(f"budget.memory.remat_policy: name must be a string, got {type(name).__name__}")
  if name.startswith("names:"):
    names = tuple(n.strip() for n in name[len("names:") :].split(",") if n.strip())
    if not names:
      raise ValueError(
        f"budget.memory.remat_policy: 'names:' needs at least one name, got {name!r}"
      )
    return policies.save_only_these_names(*names)
  attr = _POLICY_ALIASES.get(name, name)
  policy = getattr(policies, attr, None)
  if policy is None or attr.startswith("_") or attr in ("save_only_these_names",):
    known = sorted(_POLICY_ALIASES) + ["names:<a,b>"]
    raise ValueError(
      f"budget.memory.remat_policy: unknown policy {name!r}; use one of {known} or an attribute "
      "of jax.checkpoint_policies"
    )
  return policy


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One point of the plan's search space.

  Attributes:
    remat: remat policy name (see :func:`remat_policy`).
    shard_opt_state: whether the optimizer state is sharded over the data axis.
    prefetch: overlap prefetch depth: how many weight gathers may be in flight
      ahead of the compute that needs them (0: none, gathers are synchronous).
  """

  remat: str
  shard_opt_state: bool
  prefetch: int

  def __post_init__(self):
    if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
      raise ValueError(
        f"budget.memory.plan: prefetch depths must be integers >= 0, got {self.prefetch!r}"
      )


@dataclasses.dataclass(frozen=True)
class PlanRow:
  """A compiled candidate: its memory, whether it fits, and its estimated step time."""

  candidate: Candidate
  total_bytes: int | None
  fits: bool
  step_time_s: float | None
  breakdown: Breakdown | None = None
  error: str | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
  """The chosen candidate and the whole table (``str(plan)`` prints it).

  Attributes:
    budget_bytes: the per-device budget.
    target: the target name.
    choice: the fastest row that fits.
    rows: every candidate, fitting ones first by step time, then the rest by memory.
  """

  budget_bytes: int
  target: str
  choice: PlanRow
  rows: tuple[PlanRow, ...]

  def __str__(self) -> str:
    head = (
      f"memory plan for {self.target}, budget {_fmt_bytes(self.budget_bytes)} per device: "
      f"choose remat={self.choice.candidate.remat} "
      f"shard_opt_state={self.choice.candidate.shard_opt_state} "
      f"prefetch={self.choice.candidate.prefetch}"
    )
    cols = (
      "remat",
      "opt_shard",
      "prefetch",
      "total",
      "weights",
      "opt_state",
      "activ",
      "gathered",
      "grad+coll",
      "temp+other",
      "step_ms",
      "fits",
    )
    w0 = max([len(cols[0])] + [len(r.candidate.remat) for r in self.rows])
    fmt = lambda cells: " ".join([f"{cells[0]:<{w0}}"] + [f"{x:>10}" for x in cells[1:]])
    lines = [head, fmt(cols)]
    for row in self.rows:
      c = row.candidate
      if row.breakdown is None:
        lines.append(
          fmt((c.remat, str(c.shard_opt_state), str(c.prefetch))) + f"  error: {row.error}"
        )
        continue
      b = row.breakdown.categories
      cells = (
        c.remat,
        str(c.shard_opt_state),
        str(c.prefetch),
        _fmt_bytes(row.total_bytes or 0),
        _fmt_bytes(b["weights"]),
        _fmt_bytes(b["optimizer_state"]),
        _fmt_bytes(b["activations"]),
        _fmt_bytes(b["gathered_weights"]),
        _fmt_bytes(b["collective_buffers"] + b["gradients"]),
        _fmt_bytes(
          b["temporaries"] + b["fragmentation"] + b["outputs"] + b["inputs"] + b["other_arguments"]
        ),
        "-" if row.step_time_s is None else f"{1e3 * row.step_time_s:.3f}",
        ("*" if row is self.choice else "") + ("yes" if row.fits else "no"),
      )
      lines.append(fmt(cells))
    return "\n".join(lines)


def _estimate(
  estimator: Callable[..., float] | None, fn: Any, args: tuple, b: Breakdown, target: str
) -> float:
  if estimator is not None:
    return float(estimator(fn, *args, target=target))
  # The analysis of the HLO this candidate was just compiled to (no second compile).
  from jax_overlap._src import analysis

  return float(analysis.analyze_hlo(b.hlo_text, target=target).step_time_s)


def _progress(items: list, enabled: bool) -> Iterable:
  if not enabled:
    return items
  try:
    from tqdm.auto import tqdm
  except ImportError:
    return _LogProgress(items)
  return tqdm(items, desc="budget.memory.plan", unit="candidate")


class _LogProgress:
  def __init__(self, items):
    self.items = items

  def __iter__(self):
    for i, item in enumerate(self.items):
      logging.info("budget.memory.plan: candidate %d/%d: %s", i + 1, len(self.items), item)
      yield item


@deprecations.keyword_only("target", api="jax_overlap.budget.memory.plan")
def plan(
  step_builder: Callable[..., Any],
  budget_bytes: int,
  *,
  target: str = "h100x8",
  remat_policies: Sequence[str] = ("nothing", "dots", "everything"),
  shard_opt_state: Sequence[bool] = (False, True),
  prefetch: Sequence[int] = (0, 1, 2),
  estimator: Callable[..., float] | None = None,
  arg_kinds: Sequence[str | None] | None = None,
  progress: bool = True,
  cache: dict | None = None,
) -> Plan:
  """Searches remat policy x optimizer-state sharding x prefetch depth for a memory budget.

  Each candidate is built by ``step_builder(remat_policy=<policy callable>,
  shard_opt_state=<bool>, prefetch=<int>)``, which returns ``(fn, args)``:
  a (jitted) step and its arguments as ``jax.ShapeDtypeStruct`` with shardings
  on the target's compile-only mesh. The step compiles deviceless, its
  :func:`breakdown` is taken, candidates within ``budget_bytes`` per device
  are ranked by estimated step time (ties: less memory), and the fastest is
  chosen.

  Args:
    step_builder: builds a candidate, see above.
    budget_bytes: memory budget per device, in bytes (> 0).
    target: target name, e.g. ``"h100x8"``.
    remat_policies: policy names for :func:`remat_policy`.
    shard_opt_state: optimizer-state sharding choices.
    prefetch: prefetch depths.
    estimator: ``estimator(fn, *args, target=...) -> seconds``; default: the
      step time :func:`jax_overlap.analyze` gives the candidate's optimized HLO
      (read from the compile that measured its memory).
    arg_kinds: passed to :func:`breakdown`.
    progress: show a progress bar over candidates (tqdm if installed, else
      absl log lines).
    cache: a dict reused across calls (e.g. for several budgets) so each
      candidate compiles once.

  Returns:
    A :class:`Plan`.

  Raises:
    ValueError: for a budget that is not a positive number, for no candidates,
      or when no candidate fits (stating the smallest need and its candidate).
    RuntimeError: when every candidate failed to build or compile.

  Example:
    >>> def build(remat_policy, shard_opt_state, prefetch):  # doctest: +SKIP
    ...   return jax.jit(make_step(remat_policy, shard_opt_state, prefetch)), args
    >>> p = plan(build, 40 * 2**30, "h100x8")  # doctest: +SKIP
    >>> print(p)  # doctest: +SKIP
  """
  if (
    isinstance(budget_bytes, bool)
    or not isinstance(budget_bytes, (int, float))
    or not (budget_bytes > 0)
    or math.isinf(budget_bytes)
  ):
    raise ValueError(
      f"budget.memory.plan: budget_bytes must be a positive number of bytes per device, got "
      f"{budget_bytes!r}"
    )
  candidates = [
    Candidate(str(r), bool(s), int(p))
    for r in remat_policies
    for s in shard_opt_state
    for p in prefetch
  ]
  if not candidates:
    raise ValueError(
      "budget.memory.plan: the search space is empty (no remat policy, "
      "opt-state sharding or prefetch choice given)"
    )
  for name in {c.remat for c in candidates}:
    remat_policy(name)  # fail fast on unknown names
  cache = {} if cache is None else cache
  evaluated: list[tuple[Candidate, Breakdown | None, float | None, str | None]] = []
  for cand in _progress(candidates, progress):
    key = (target, cand)
    if key not in cache:
      try:
        built = step_builder(
          remat_policy=remat_policy(cand.remat),
          shard_opt_state=cand.shard_opt_state,
          prefetch=cand.prefetch,
        )
        fn, args = built[0], tuple(built[1])
        b = breakdown(fn, *args, target=target, arg_kinds=arg_kinds)
        t = _estimate(estimator, fn, args, b, target)
        cache[key] = (b, t, None)
      except Exception as e:  # a candidate that does not build or compile is reported, not fatal
        logging.warning("budget.memory.plan: candidate %s failed: %s", cand, e)
        cache[key] = (None, None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
    evaluated.append((cand, *cache[key]))
  rows = [
    PlanRow(c, b.total_bytes if b else None, bool(b and b.total_bytes <= budget_bytes), t, b, err)
    for c, b, t, err in evaluated
  ]
  ok = [r for r in rows if r.breakdown is not None]
  if not ok:
    raise RuntimeError(
      "budget.memory.plan: every candidate failed to build or compile; first error: "
      f"{rows[0].error}"
    )
  fitting = sorted((r for r in ok if r.fits), key=lambda r: (r.step_time_s, r.total_bytes))
  if not fitting:
    smallest = min(ok, key=lambda r: r.total_bytes)
    raise ValueError(
      f"budget.memory.plan: no candidate fits {_fmt_bytes(budget_bytes)} per device on "
      f"{target}; the smallest needs {_fmt_bytes(smallest.total_bytes)} ({smallest.total_bytes} "
      f"bytes) with remat={smallest.candidate.remat} "
      f"shard_opt_state={smallest.candidate.shard_opt_state} "
      f"prefetch={smallest.candidate.prefetch}"
    )
  rest = sorted(
    (r for r in rows if not r.fits), key=lambda r: (r.total_bytes is None, r.total_bytes or 0)
  )
  return Plan(int(budget_bytes), str(target), fitting[0], tuple(fitting + rest))
