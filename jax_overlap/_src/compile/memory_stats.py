"""XLA's memory analysis of a compiled step, as a typed record."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jax_overlap._src import deprecations

__all__ = ["MemoryStats", "memory_stats"]


@dataclasses.dataclass(frozen=True)
class MemoryStats(deprecations.ReadAsDict):
  """XLA's memory analysis of one compiled step, in bytes per device.

  Attributes:
    arguments: the step's parameters (``argument_size_in_bytes``).
    outputs: its results (``output_size_in_bytes``).
    temporaries: XLA's scratch buffers (``temp_size_in_bytes``).
    aliased: outputs that reuse an argument's buffer (``alias_size_in_bytes``).
  """

  arguments: int = 0
  outputs: int = 0
  temporaries: int = 0
  aliased: int = 0

  _was_dict = "Report.memory"

  @classmethod
  def of(cls, value: MemoryStats | Mapping[str, int] | None) -> MemoryStats | None:
    """``value`` as MemoryStats: a mapping with these field names (as in a report's JSON),
    MemoryStats itself, or None; an empty mapping is None (the backend gave none)."""
    if value is None or isinstance(value, MemoryStats):
      return value
    if not isinstance(value, Mapping):
      raise TypeError(
        f"memory: expected analysis.MemoryStats or a mapping of byte counts, got "
        f"{type(value).__name__}"
      )
    if not value:
      return None
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(value) - set(names))
    if unknown:
      raise ValueError(f"memory: unknown keys {unknown}; the keys are {', '.join(names)}")
    return cls(**{k: int(v) for k, v in value.items()})


def memory_stats(compiled: Any) -> MemoryStats | None:
  """XLA's memory statistics of a compiled executable; None where it gives none."""
  try:
    stats = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - not every backend implements it
    return None
  if stats is None:
    return None
  return MemoryStats(
    arguments=int(stats.argument_size_in_bytes),
    outputs=int(stats.output_size_in_bytes),
    temporaries=int(stats.temp_size_in_bytes),
    aliased=int(stats.alias_size_in_bytes),
  )
