"""Names a public module loads on first use (PEP 562), so that importing it needs no JAX.

Used by ``jax_overlap/__init__.py`` and ``jax_overlap/runtime.py``: the launcher wrapper,
plan checks and the command line start without importing JAX. Imports nothing heavy.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def attach(
  package: str, namespace: dict[str, Any], submodules: Sequence[str], names: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
  """``(__getattr__, __dir__)`` for module ``package`` whose globals are ``namespace``.

  ``submodules`` are loaded once and kept in ``namespace``; each of ``names`` (name ->
  the module defining it) is looked up on every access, so it is always its module's
  current one (a name first used while a test patches its module is not kept patched).
  """

  def __getattr__(name: str) -> Any:
    if name in submodules:
      value = importlib.import_module(f"{package}.{name}")
      namespace[name] = value
      return value
    if name in names:
      return getattr(importlib.import_module(names[name]), name)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")

  def __dir__() -> list[str]:
    return sorted(set(namespace) | set(namespace.get("__all__", ())))

  return __getattr__, __dir__
