"""On-disk memory of @overlap's choice of variant.

Choosing a variant compiles the step several times deviceless (tens of seconds
on a large model). The choice depends only on the traced program, the
arguments' shapes and shardings, the target, the decorator's settings, the
installed jax/jaxlib and jax_overlap's own code, so a restarted job with the
same step can reuse it. Every variant computes the same values; a stale entry
could only cost speed, and the key covers everything the choice is made from.

Entries live in ``<cache dir>/selection/<key>.json`` (see ``cache.cache_dir``).
A missing, unreadable or malformed entry is a miss; a directory that cannot be
written means nothing is remembered.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import re
from typing import Any

import jax
import jaxlib

from jax_overlap._src import cache
from jax_overlap._src.analysis import calibration

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@functools.cache
def _code_fingerprint() -> str:
  """A hash of jax_overlap's own sources (all of ``_src``): a new version of the cost model
  is a miss."""
  h = hashlib.sha256()
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for path in sorted(glob.glob(os.path.join(here, "**", "*.py"), recursive=True)):
    with open(path, "rb") as f:
      h.update(path[len(here) :].encode() + b"\0" + f.read())
  return h.hexdigest()


def key(program: str, signature: Any, settings: dict[str, Any]) -> str | None:
  """The entry name for a program (jaxpr text), its argument signature and settings.

  Returns None when the settings cannot be written as JSON (nothing is cached).
  """
  try:
    text = json.dumps(
      {
        "settings": settings,
        "signature": repr(signature),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "code": _code_fingerprint(),
        "calibrations": calibration.fingerprint(),
      },
      sort_keys=True,
    )
  except TypeError:
    return None
  h = hashlib.sha256(_ADDRESS.sub("", text).encode())
  h.update(_ADDRESS.sub("", program).encode())  # function reprs inside custom_vjp params
  return h.hexdigest()[:32]


def _path(k: str) -> str:
  return os.path.join(cache.cache_dir(), "selection", k + ".json")


def load(k: str) -> dict[str, Any] | None:
  """The stored entry, or None if there is none or it cannot be read."""
  try:
    with open(_path(k)) as f:
      entry = json.load(f)
  except (OSError, ValueError):
    return None
  fields = {"chosen": str, "base": str, "options": dict, "estimates": list, "failed": list}
  if not isinstance(entry, dict) or any(not isinstance(entry.get(n), t) for n, t in fields.items()):
    return None
  return entry


def store(k: str, entry: dict[str, Any]) -> str | None:
  """Writes ``entry`` atomically; returns its path, or None if it could not be written."""
  path = _path(k)
  try:
    cache.write_text(path, json.dumps(entry, indent=1, sort_keys=True))
  except (OSError, TypeError):
    return None
  return path
