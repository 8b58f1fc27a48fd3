"""Priority annotations users put on collectives (:class:`priority`)."""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable
from typing import Literal

from jax.experimental.xla_metadata import set_xla_metadata

# ---------------------------------------------------------------------------
# Manual annotation.
# ---------------------------------------------------------------------------


PriorityClass = Literal["high", "normal", "low"]


class priority:  # noqa: N801 - used as a context manager, like jax's own
  """Marks the collectives (and ops) traced inside as a priority class.

  ``with jax_overlap.priority("high"): y = jax.lax.all_gather(...)`` attaches
  the frontend attribute ``_jax_overlap_priority="high"`` to the enclosed ops;
  it reaches the compiled HLO, where the analysis reports it on each collective
  (``CollectiveInfo.annotations``). The streams' priority at run time is a runtime
  plan's ``streams.priority``, not this class. Also usable as a decorator.
  """

  _CLASSES: tuple[str, ...] = typing.get_args(PriorityClass)

  def __init__(self, level: PriorityClass = "high"):
    if level not in self._CLASSES:
      raise ValueError(f"priority: level must be one of {', '.join(self._CLASSES)}, got {level!r}")
    self.level = level
    self._cm = None

  def __enter__(self):
    self._cm = set_xla_metadata(_jax_overlap_priority=self.level)
    return self._cm.__enter__()

  def __exit__(self, *exc):
    cm, self._cm = self._cm, None
    return cm.__exit__(*exc)

  def __call__(self, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
      with priority(self.level):
        return fn(*args, **kwargs)

    return wrapped
