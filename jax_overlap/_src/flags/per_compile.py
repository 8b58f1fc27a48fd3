"""XLA options spelled the way the installed jaxlib takes them per compile.

``XLA_FLAGS`` and per-compile options (``jax.jit(..., compiler_options=...)``) are read by
different parsers: a per-compile option is a field of XLA's ``DebugOptions`` message, named
and valued as in its proto. Since jaxlib 0.11 the loop pipeliner's switches are enums
(``xla_gpu_pipeline_all_gather`` ..., values ``COLLECTIVE_PIPELINING_MODE_ON`` ...):
``XLA_FLAGS`` still takes the earlier bool names and the short values (``on``), a
per-compile option takes neither, and a compile given one fails. :func:`spelled` turns
options into what this jaxlib takes per compile, for the options the registry knows in
more than one spelling, by asking jaxlib: a helper process compiles a one-line function on
its CPU client with each candidate spelling (a second or two, once per jaxlib version:
answers are cached in memory and under the jax_overlap cache directory). Other options pass
unchanged.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from jax_overlap._src.errors import ConfigError
from jax_overlap._src.flags.probe import Answers
from jax_overlap._src.flags.registry import REGISTRY, Flag

__all__ = ["spelled", "accepted", "unknown_option_error"]

# Runs in a helper process: stdin is a JSON list of [name, value]; stdout one JSON list of
# [accepted, XLA's message].
_HELPER = r"""
import json, sys
import jax
answers = []
for name, value in json.load(sys.stdin):
  try:
    jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(1.0).compile()
    answers.append([True, ""])
  except Exception as e:
    answers.append([False, str(e).strip().splitlines()[0][:400] if str(e).strip() else repr(e)])
sys.stdout.write("JAX_OVERLAP_PER_COMPILE" + json.dumps(answers) + "\n")
"""
_MARK = "JAX_OVERLAP_PER_COMPILE"

_answers = Answers("compile_options", 2)


def _key(name: str, value: Any) -> str:
  return json.dumps([name, value])


def _ask(items: list[tuple[str, Any]]) -> list[tuple[bool, str]]:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LD_PRELOAD")}
  env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
  try:
    p = subprocess.run(
      [sys.executable, "-c", _HELPER],
      input=json.dumps(items),
      capture_output=True,
      text=True,
      env=env,
      timeout=300,
    )
  except (OSError, subprocess.TimeoutExpired) as e:
    raise ConfigError(f"flags: could not ask jaxlib which compile options it takes: {e}") from e
  line = next((ln for ln in p.stdout.splitlines() if ln.startswith(_MARK)), None)
  if line is None:
    raise ConfigError(
      "flags: the jaxlib compile-option probe failed: " + (p.stderr.strip()[-600:] or str(p))
    )
  return [(bool(ok), str(msg)) for ok, msg in json.loads(line[len(_MARK) :])]


def accepted(items: list[tuple[str, Any]]) -> dict[tuple[str, Any], tuple[bool, str]]:
  """Whether the installed jaxlib compiles with each ``(name, value)`` as a per-compile
  option: ``{(name, value): (accepted, XLA's message)}``.

  Raises:
    ConfigError: if the helper process cannot run.
  """
  with _answers.lock:
    _answers.load()
    todo = list(dict.fromkeys((n, v) for n, v in items if _key(n, v) not in _answers.entries))
    if todo:
      for (n, v), (ok, msg) in zip(todo, _ask(todo)):
        _answers.entries[_key(n, v)] = [ok, msg]
      _answers.save()
    return {(n, v): tuple(_answers.entries[_key(n, v)]) for n, v in items}


def _proto_value(flag: Flag, value: Any) -> Any:
  """``value`` as the DebugOptions enum names it (``on`` -> ``<ENUM>_ON``)."""
  if flag.proto_enum and isinstance(value, str) and not value.startswith(flag.proto_enum):
    return f"{flag.proto_enum}_{value.upper()}"
  return value


def _as(flag: Flag, target: Flag, value: Any) -> Any:
  """``value`` of ``flag`` as the value of its other spelling ``target``."""
  if target.type == "enum" and isinstance(value, bool):
    return _proto_value(target, "on" if value else "off")
  if target.type == "bool" and isinstance(value, str):
    short = value.lower().rsplit("_", 1)[-1] if flag.proto_enum else value.lower()
    return short == "on"
  return _proto_value(target, value)


def _others(name: str) -> list[Flag]:
  """The registered spellings of the same option: its replacement and what it replaced."""
  flag = REGISTRY[name]
  out = [REGISTRY[flag.replacement]] if flag.replacement in REGISTRY else []
  out += [f for f in REGISTRY.values() if f.replacement == name]
  return out


def spelled(options: Mapping[str, Any]) -> dict[str, Any]:
  """``options`` with each option the registry knows in several spellings (renamed, or an
  enum whose per-compile values are proto names) in the first spelling the installed
  jaxlib compiles with; everything else unchanged. An option no spelling of which is
  accepted is kept as given, so XLA's own error names it.

  Raises:
    ConfigError: if jaxlib cannot be asked.
  """
  choices: dict[str, list[tuple[str, Any]]] = {}
  for name, value in options.items():
    flag = REGISTRY.get(name)
    if flag is None or flag.kind != "xla":
      continue
    others = _others(name)
    if not others and not flag.proto_enum:
      continue
    first = (name, _proto_value(flag, value))
    choices[name] = [first, *((o.name, _as(flag, o, value)) for o in others)]
  if not choices:
    return dict(options)
  verdicts = accepted([c for cands in choices.values() for c in cands])
  out: dict[str, Any] = {}
  for name, value in options.items():
    if name not in choices:
      out[name] = value
      continue
    ok = [c for c in choices[name] if verdicts[c][0]]
    new_name, new_value = ok[0] if ok else (name, value)
    out[new_name] = new_value
  return out


_NO_SUCH_OPTION = re.compile(r"No such compile option: '([^']+)'")


def unknown_option_error(api: str, error: BaseException) -> ValueError | None:
  """For XLA's "No such compile option" (a per-compile option the installed jaxlib does not
  have): a ``ValueError`` naming the option, what XLA did with it and the closest option it
  takes (as :func:`jax_overlap.flags.validate` suggests); None for any other error."""
  m = _NO_SUCH_OPTION.search(str(error))
  if m is None:
    return None
  from jax_overlap._src.flags import validation

  name = m.group(1)
  flag = REGISTRY.get(name)
  if flag is not None and flag.replacement:
    hint = f"; use {flag.replacement} instead"
  else:
    close = validation.close_name(name)
    hint = f"; did you mean {close}?" if close else ""
  return ValueError(
    f"{api}: xla_options names {name!r}, which is not an option of jaxlib "
    f'{_jaxlib_version()}: per compile, XLA refuses the compile ("No such compile option")'
    f"{hint}"
  )


def _jaxlib_version() -> str:
  import jaxlib

  return jaxlib.__version__
