"""Where a step's per-device memory goes: :func:`breakdown` splits XLA's own total into
categories that sum to it exactly (arguments from their pytrees and shardings, the temp
buffer from the compiler's buffer assignment, read by :mod:`.dump`)."""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import jax
from absl import logging

from jax_overlap._src import deprecations, errors
from jax_overlap._src.budget.memory.dump import (
  CATEGORIES,
  _attribute_temp,
  _parse_buffer_assignment,
  _parse_hlo,
  _parse_live_ranges,
  _read_dump,
)
from jax_overlap._src.compile import compiler as compile_lib

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
    notes: what the compile assumed (e.g. cuBLAS GEMMs where XLA's deviceless Triton
      emitter found no tile sizes, as the analysis does).
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
  notes: tuple[str, ...] = ()

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
    lines += [f"  note: {n}" for n in self.notes]
    return "\n".join(lines)


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


def _compile(lowered, options: dict, target: str | None, notes: list[str]):
  """(XLA's executable, the folder its dump is in). A deviceless compile that XLA's Triton
  GEMM emitter cannot tile is compiled again with the analysis's fallback (a note says so),
  into a folder of its own; any other failure is a RuntimeError with XLA's message."""
  from jax_overlap._src import targets as _targets

  try:
    topo = _targets.get(target) if target is not None else None
  except ValueError:
    topo = None  # a platform name such as "cpu": no deviceless compile
  retry = os.path.join(options["xla_dump_to"], "fallback")
  try:
    compiled, fallback = compile_lib.compile_lowered(lowered, options, topo, retry_dump_to=retry)
  except Exception as e:  # noqa: BLE001 - XLA raises JaxRuntimeError and others
    raise compile_lib.failure(
      "budget.memory.breakdown: XLA could not compile the step", e, topo
    ) from e
  if not fallback:
    return compiled, options["xla_dump_to"]
  notes.append(
    compile_lib.TILING_NOTE.format(options=compile_lib.spelled(fallback), what="breakdown")
  )
  return compiled, retry


def _local_platforms() -> set[str]:
  """The platforms this process has devices of (a target may name one: ``"cpu"``)."""
  return {d.platform for d in jax.devices()}


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
  if target is not None and target not in _local_platforms():
    from jax_overlap._src import targets as _targets

    try:
      _targets.get(target)
    except ValueError as e:
      raise ValueError(
        f"budget.memory.breakdown: {e}, or a platform of this machine "
        f"({', '.join(sorted(_local_platforms()))})"
      ) from None
  args = _place_on_target(args, target)
  jitted = (
    fn if hasattr(fn, "lower") else jax.jit(fn, donate_argnums=donate_argnums, keep_unused=True)
  )
  options = dict(xla_options or {})
  notes: list[str] = []
  with tempfile.TemporaryDirectory(prefix="jax_overlap_mem_") as tmp:
    options["xla_dump_to"] = tmp
    traced = errors.trace_user_fn(
      "budget.memory.breakdown", fn, tuple(args), {}, lambda: jitted.trace(*args)
    )
    compiled, tmp = _compile(traced.lower(), options, target, notes)
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
    notes=tuple(notes),
  )
