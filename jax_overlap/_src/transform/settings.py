"""The settings of one ``@overlap`` decoration, checked once when it is applied.

``overlap``'s keywords become a frozen :class:`Settings`; the decorated step
(``Overlapped``), the variants and the selection cache read them from there.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from typing import Any, Literal

from jax_overlap._src import flags as flags_lib
from jax_overlap._src import targets as targets_lib

ReduceScatter = Literal["per_layer", "as_written"]
CollectiveMatmul = Literal["auto", "on", "ring", "pieces", "off"]
WeightGradients = Literal["defer", "as_written"]
Annotate = Literal[True, False, "auto"]
Select = Literal["cost_model", "measure", "rewrite"]
Gspmd = Literal["auto", "convert", "as_written"]


_CHOICES = {
  "reduce_scatter": ReduceScatter,
  "select": Select,
  "collective_matmul": CollectiveMatmul,
  "gspmd": Gspmd,
  "weight_gradients": WeightGradients,
}


def _choices(literal) -> str:
  names = [repr(c) if isinstance(c, str) else str(c) for c in typing.get_args(literal)]
  return ", ".join(names[:-1]) + " or " + names[-1]


def _check_choice(name: str, value, literal) -> None:
  # ``1 in (True, ...)`` holds, so bools and strings are compared by type as well.
  if not any(type(value) is type(c) and value == c for c in typing.get_args(literal)):
    raise ValueError(f"overlap: {name} must be {_choices(literal)}, got {value!r}")


def _check_bool(name: str, value) -> None:
  if not isinstance(value, bool):
    raise TypeError(f"overlap: {name} must be True or False, got {value!r}")


_UNITS = {
  "b": 1,
  "kb": 10**3,
  "mb": 10**6,
  "gb": 10**9,
  "tb": 10**12,
  "kib": 2**10,
  "mib": 2**20,
  "gib": 2**30,
  "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def byte_count(value, what: str) -> int | None:
  """A number of bytes as given to a setting: an int (or a float holding a whole number), a
  string with a unit (``"2GiB"``, ``"512 MiB"``, ``"1.5GB"``: KiB, MiB, GiB, TiB are powers of
  1024, kB, MB, GB, TB of 1000; no unit: bytes) or None; a fraction of a byte is dropped.

  Args:
    value: what was given.
    what: the API and keyword, for the errors (``"overlap: prefetch_memory"``).

  Returns:
    The bytes, or None for None.

  Raises:
    TypeError: for anything but an int, a float, a string or None (a bool included).
    ValueError: for a negative or fractional number, or a string that is not a size.

  Example:
    >>> byte_count("1.5 KiB", "overlap: prefetch_memory")
    1536
  """
  hint = "a number of bytes >= 0: an int, or a string such as '2GiB' or '512 MiB'"
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float, str)):
    raise TypeError(f"{what} must be {hint}, got {value!r} ({type(value).__name__})")
  if isinstance(value, str):
    m = _SIZE.fullmatch(value)
    unit = m[2].lower() if m else ""
    if m is None or (unit and unit not in _UNITS):
      raise ValueError(
        f"{what} must be {hint} (units: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB), got {value!r}"
      )
    return math.floor(float(m[1]) * _UNITS[unit or "b"])
  if isinstance(value, float) and not (math.isfinite(value) and value == int(value)):
    raise ValueError(f"{what} must be {hint} (a whole number), got {value!r}")
  if value < 0:
    raise ValueError(f"{what} must be {hint}, got {value!r}")
  return int(value)


@dataclasses.dataclass(frozen=True)
class Settings:
  """``overlap``'s keywords (see its docstring), checked; ``params_argnums`` as a tuple."""

  mesh: Any = None
  # One topology (``targets.get`` of what was passed); None: the devices the step runs on.
  target: targets_lib.Topology | None = None
  prefetch: int = 1
  prefetch_memory: int | None = None  # bytes (``byte_count`` of what was passed)
  reduce_scatter: ReduceScatter = "per_layer"
  collective_matmul: CollectiveMatmul = "auto"
  weight_gradients: WeightGradients = "defer"
  annotate: Annotate = "auto"
  xla_options: dict[str, Any] = dataclasses.field(default_factory=dict)
  workload: str = "fsdp"
  select: Select = "cost_model"
  schedule_from_estimates: bool = True
  cache: bool = True
  params_argnums: tuple[int, ...] = (0,)
  gspmd: Gspmd = "auto"
  jit_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    p = self.prefetch
    if not isinstance(p, int) or isinstance(p, bool) or p < 0:
      raise ValueError(f"overlap: prefetch must be a non-negative integer, got {p!r}")
    cap = byte_count(self.prefetch_memory, "overlap: prefetch_memory")
    if cap is not None and p == 0:
      raise ValueError(
        f"overlap: prefetch_memory={self.prefetch_memory!r} caps the parameter all-gathers "
        "issued ahead of their first use, and prefetch=0 issues none ahead (they stay where "
        "written); use prefetch >= 1 with it, or leave prefetch_memory=None"
      )
    object.__setattr__(self, "prefetch_memory", cap)
    for name, literal in _CHOICES.items():
      _check_choice(name, getattr(self, name), literal)
    if self.target is not None:
      object.__setattr__(self, "target", targets_lib.get(self.target))
    flags_lib.check_workload(self.workload)
    if "compiler_options" in self.jit_kwargs:
      raise ValueError("overlap: pass XLA options as xla_options=, not compiler_options=")
    _check_bool("cache", self.cache)
    _check_bool("schedule_from_estimates", self.schedule_from_estimates)
    _check_choice("annotate", self.annotate, Annotate)
    argnums = self.params_argnums
    argnums = (argnums,) if isinstance(argnums, int) and not isinstance(argnums, bool) else argnums
    if (
      not isinstance(argnums, tuple)
      or not argnums
      or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in argnums)
    ):
      raise ValueError(
        "overlap: params_argnums must be a non-negative int or a non-empty tuple of them, got "
        f"{self.params_argnums!r}"
      )
    object.__setattr__(self, "params_argnums", argnums)
    object.__setattr__(self, "xla_options", dict(self.xla_options or {}))
    object.__setattr__(self, "jit_kwargs", dict(self.jit_kwargs))

  def converts(self) -> bool:
    """Whether a GSPMD step is also tried in its shard_map form."""
    if self.gspmd == "auto":
      return self.target is not None and self.select != "rewrite"
    return self.gspmd == "convert"

  def gather_merge_bytes(self, n: int) -> int:
    """The most bytes XLA may merge into one all-gather where ``n`` would do: ``n``, or the
    memory cap where it is smaller (0: none merged), so that a merged gather does not hold
    more than the cap."""
    return int(n if self.prefetch_memory is None else min(n, self.prefetch_memory))

  def key(self, annotate: bool, jit_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What the choice is made from besides the program: these settings and the jit
    keywords the variants compile with (output layouts, donation: they change what XLA
    compiles), by value."""
    return {
      "target": self.target.name if self.target is not None else None,
      "workload": self.workload,
      "prefetch": self.prefetch,
      "prefetch_memory": self.prefetch_memory,
      "params_argnums": list(self.params_argnums),
      "reduce_scatter": self.reduce_scatter,
      "collective_matmul": self.collective_matmul,
      "weight_gradients": self.weight_gradients,
      "annotate": annotate,
      "select": self.select,
      "schedule_from_estimates": self.schedule_from_estimates,
      "xla_options": self.xla_options,
      "jit_kwargs": {k: repr(v) for k, v in sorted(jit_kwargs.items())},
      "gspmd": self.gspmd,
    }
