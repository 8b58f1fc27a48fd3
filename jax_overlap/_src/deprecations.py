"""Old spellings of public arguments, kept working for one release with a warning.

The public API uses one name per concept (``docs/glossary.md``): ``target=``
keyword-only, ``xla_options=`` for XLA options, ``cost_model=`` for the
analysis' cost settings. Calls written against the earlier spellings still run;
each warns once per call site with a :class:`JaxOverlapDeprecationWarning`
naming the spelling to use instead.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
  "JaxOverlapDeprecationWarning",
  "ReadAsDict",
  "keyword_only",
  "merged_overrides",
  "renamed",
  "warn",
]


class JaxOverlapDeprecationWarning(DeprecationWarning):
  """An argument spelled the way an earlier release of jax_overlap spelled it."""


def warn(api: str, message: str) -> None:
  """Warns, attributed to the first caller outside jax_overlap."""
  frame, level = sys._getframe(0), 1
  while frame is not None and frame.f_globals.get("__name__", "").startswith("jax_overlap."):
    frame, level = frame.f_back, level + 1
  warnings.warn(f"{api}: {message}", JaxOverlapDeprecationWarning, stacklevel=level)


def keyword_only(*names: str, api: str) -> Callable:
  """Decorates a function whose ``names`` became keyword-only (in that order after its
  positional parameters): positional values for them still bind, with a warning.
  ``api``: the public name the warning gives."""

  def wrap(fn: Callable) -> Callable:
    params = inspect.signature(fn).parameters.values()
    positional = sum(
      p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in names for p in params
    )
    has_var_args = any(p.kind == p.VAR_POSITIONAL for p in params)
    if has_var_args:
      raise TypeError(f"keyword_only: {fn.__qualname__} takes *args")

    @functools.wraps(fn)
    def call(*args, **kwargs):
      if len(args) > positional:
        extra = args[positional:]
        if len(extra) > len(names):
          raise TypeError(
            f"{api}() takes {positional} positional argument(s) and keyword-only "
            f"{', '.join(n + '=' for n in names)}; got {len(args)} positional"
          )
        for name, value in zip(names, extra):
          if name in kwargs:
            raise TypeError(f"{api}() got {name!r} both by position and as {name}=")
          kwargs[name] = value
        warn(
          api,
          "pass " + ", ".join(f"{n}=" for n in names[: len(extra)]) + " by keyword; "
          "positional values are deprecated",
        )
        args = args[:positional]
      return fn(*args, **kwargs)

    return call

  return wrap


def renamed(mapping: Mapping[str, str], *, api: str) -> Callable:
  """Decorates a function whose keyword arguments ``old`` are now spelled ``mapping[old]``.
  ``api``: the public name the warning gives."""

  def wrap(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(*args, **kwargs):
      for old, new in mapping.items():
        if old in kwargs:
          if new in kwargs:
            raise TypeError(f"{api}() got both {old}= and {new}=; pass only {new}=")
          kwargs[new] = kwargs.pop(old)
          warn(api, f"{old}= is deprecated; use {new}=")
      return fn(*args, **kwargs)

    return call

  return wrap


def merged_overrides(api: str, xla_options: Mapping[str, Any] | None, overrides: dict) -> dict:
  """``xla_options`` with XLA options given the earlier way, as ``**overrides``, added."""
  if overrides:
    warn(
      api,
      f"XLA options as keyword arguments ({', '.join(sorted(overrides))}) are deprecated; "
      "pass xla_options={...}",
    )
  out = dict(xla_options or {})
  for k, v in overrides.items():
    if k in out:
      raise TypeError(f"{api}: {k} given both in xla_options and as a keyword argument")
    out[k] = v
  return out


class ReadAsDict:
  """For a dataclass that an earlier release returned as a dict: ``record[key]`` reads the
  field of that name, with a warning, for one release. ``_was_dict`` names what was a dict
  (``"sim.TuneResult.table rows"``)."""

  _was_dict = "this record"
  __iter__ = None  # not a mapping: iter(record) is a TypeError, as for any record

  def __getitem__(self, key: str) -> Any:
    names = [f.name for f in dataclasses.fields(self)]  # type: ignore[arg-type]
    if key not in names:
      raise KeyError(f"{type(self).__name__} has {', '.join(names)}, not {key!r}")
    warn(
      self._was_dict,
      f"these are {type(self).__name__} records now: read .{key} instead of [{key!r}]",
    )
    return getattr(self, key)
