"""Options with which the installed XLA aborts the process compiling some programs.

Some jaxlib releases have bugs that end the process (a C++ ``CHECK`` failure, or a
segmentation fault) when a program of some kind is compiled with an option set (the
registry's :class:`.Abort` entries: which value, which programs, the versions seen to
abort and not to). No Python error can be caught there, so jax_overlap asks before it compiles: on every jaxlib
version the registry has not seen compile such programs, a helper process compiles a
small program of that kind with the option (deviceless, for ``h100x8``) and reports
whether XLA aborted, once per jaxlib version (cached in memory and under the jax_overlap
cache directory). Where the helper cannot compile deviceless (no CUDA plugin), the
registry's record decides (aborts from the first version seen on).

* :func:`aborting` lists the options of a set that abort the installed XLA for a kind of
  program; :func:`recommended <.configuration.recommended>` leaves them out.
* :func:`check_program` raises :class:`~jax_overlap.ConfigError` instead of compiling a
  program the options would abort on (options given per compile or in ``XLA_FLAGS``).
  For a size threshold (``Abort.up_to``), every value up to the size of the program's
  largest dot operand aborts, not the registry's value alone; dots inside ``shard_map``
  bodies are not counted (the SPMD partitioner leaves them as they are).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

from jax_overlap._src.errors import ConfigError
from jax_overlap._src.flags import probe as probe_lib
from jax_overlap._src.flags import syntax
from jax_overlap._src.flags.registry import REGISTRY, Flag

__all__ = [
  "aborting",
  "aborts",
  "check_program",
  "largest_dot_operand_bytes",
  "probe",
  "program_kinds",
]

# Runs in a helper process: argv[1] the option, argv[2] its value as JSON. A program with
# a while loop (grad of a two-step lax.scan over sharded layers), compiled deviceless.
_HELPER = r"""
import json, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jax_overlap._src.targets import compile_only_mesh
name, value = sys.argv[1], json.loads(sys.argv[2])
try:
  mesh = compile_only_mesh("h100x8", {"x": 8})
except Exception as e:
  print("JAX_OVERLAP_ABORT_PROBE unknown", repr(e)[:300]); sys.exit(0)
def layer(c, w):
  return c + jnp.tanh(c @ w[0]) @ w[1], None
loss = lambda w, c: jnp.sum(jax.lax.scan(layer, c, w)[0].astype(jnp.float32) ** 2)
w = jax.ShapeDtypeStruct((2, 2, 128, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, None, None, "x")))
c = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
options = {"xla_gpu_enable_latency_hiding_scheduler": True, name: value}
jax.jit(jax.grad(loss)).lower(w, c).compile(options)
print("JAX_OVERLAP_ABORT_PROBE compiled")
"""
_MARK = "JAX_OVERLAP_ABORT_PROBE"
_GLOG_PREFIX = re.compile(r"^[FEWI]\d{4} [\d:.]+\s+\d+\s+")

_answers = probe_lib.Answers("aborts", 2)
# (option, jaxlib version) -> the registry's record, where XLA could not be asked: kept for
# this process (one helper process per question), not written (the next one asks again).
_unasked: dict[tuple[str, str], tuple[bool, str]] = {}


def _enables(flag: Flag, value: Any) -> bool:
  """Whether ``value`` (as given per compile or in ``XLA_FLAGS``; None for a bare flag) is
  the value ``flag`` aborts with."""
  assert flag.aborts is not None
  text = "true" if value is None else syntax.format_value(value).strip().lower()
  if flag.type == "bool":
    text = {"1": "true", "0": "false"}.get(text, text)
  if flag.aborts.up_to is not None:  # a threshold: any value from the registry's on
    try:
      return float(text) >= float(flag.aborts.value)
    except ValueError:
      return False  # not a number: XLA rejects it with an error, it does not abort
  return text == flag.aborts.value


# A dot in StableHLO text: its operand and result types.
_DOT = re.compile(r"stablehlo\.dot(?:_general)?\b[^\n]*?: \(([^\n]*?)\) -> (tensor<[^>]*>)")
_TENSOR = re.compile(r"tensor<((?:\d+x)*)[a-zA-Z]+(\d+)[a-zA-Z0-9]*>")  # bf16, f8E4M3FN, i1


# Function names, plain or quoted (``@main``, ``@"<lambda>"``).
_FUNC = re.compile(r'func\.func\b[^@]*@("[^"]*"|[\w.$-]+)\(')
_CALL = re.compile(r'(?:func\.)?call @("[^"]*"|[\w.$-]+)\(')


def _text(lowered) -> str:
  """A ``jax.stages.Lowered``'s StableHLO text (or the text itself)."""
  return lowered if isinstance(lowered, str) else lowered.as_text()


def _functions(text: str) -> dict[str, list[str]]:
  """The functions of StableHLO ``text``: name -> its lines, by brace depth."""
  functions: dict[str, list[str]] = {}
  name, depth = None, 0
  for line in text.splitlines():
    m = _FUNC.search(line) if name is None else None
    if m:
      name, depth = m.group(1), 0
      functions[name] = []
    if name is None:
      continue
    functions[name].append(line)
    depth += line.count("{") - line.count("}")
    if depth <= 0 and not m:
      name = None
  return functions


def _outside_shard_map(lines: list[str]):
  """The lines of a function outside its shard_map bodies (``sdy.manual_computation``
  regions)."""
  depth, manual_until = 0, None
  for line in lines:
    opens = manual_until is None and "sdy.manual_computation(" in line
    if manual_until is None and not opens:
      yield line
    depth += line.count("{") - line.count("}")
    if opens and line.count("{") > line.count("}"):
      manual_until = depth - 1  # the region ends where the depth falls back
    elif manual_until is not None and depth <= manual_until:
      manual_until = None


def largest_dot_operand_bytes(lowered) -> int:
  """The bytes of the largest operand or result of a dot in ``lowered`` (a
  ``jax.stages.Lowered`` or its text) that XLA's SPMD partitioner handles: at the
  program's (global) shapes, outside ``shard_map`` bodies, whose dots are the user's own
  per-device ones and are never windowed. Functions are followed from ``main`` through
  the calls made outside shard_map bodies."""
  text = _text(lowered)
  functions, outside = _functions(text), _outside_shard_map
  if "main" not in functions:  # not the text expected: every dot counts
    functions, outside = {"main": text.splitlines()}, lambda lines: lines
  largest, seen = 0, set()
  todo = ["main"]
  while todo:
    f = todo.pop()
    if f in seen or f not in functions or f.startswith("shmap_body"):
      continue
    seen.add(f)
    for line in outside(functions[f]):
      todo.extend(_CALL.findall(line))
      for operands, result in _DOT.findall(line):
        for dims, bits in _TENSOR.findall(operands + " " + result):
          n = max(int(bits) // 8, 1)
          for d in dims.split("x")[:-1]:
            n *= int(d)
          largest = max(largest, n)
  return largest


def _per_compile_value(flag: Flag) -> Any:
  assert flag.aborts is not None
  if flag.type == "bool":
    return flag.aborts.value == "true"
  if flag.type in ("int", "float"):
    return (int if flag.type == "int" else float)(flag.aborts.value)
  return flag.aborts.value


def probe(name: str) -> tuple[bool | None, str]:
  """Compiles the registry's kind of program with option ``name`` at the value it aborts
  with, in a helper process: (True: XLA ended the process, by a failed CHECK or a fault;
  False: it compiled; None: the helper could not compile deviceless), with XLA's last
  words or the reason."""
  flag = REGISTRY[name]
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LD_PRELOAD")}
  env.update(JAX_PLATFORMS="cpu")
  try:
    p = subprocess.run(
      [sys.executable, "-c", _HELPER, name, json.dumps(_per_compile_value(flag))],
      capture_output=True,
      text=True,
      env=env,
      timeout=600,
    )
  except (OSError, subprocess.TimeoutExpired) as e:
    return None, f"the helper process did not finish: {e}"
  if p.returncode < 0:  # ended by a signal: a failed CHECK aborts, a bad access faults
    checks = [ln for ln in p.stderr.splitlines() if "Check failed" in ln]
    # glog's prefix (severity, date, time, thread) is not part of the message.
    if checks:
      return True, _GLOG_PREFIX.sub("", checks[-1].strip())[:400]
    try:
      name = signal.Signals(-p.returncode).name
    except ValueError:
      name = f"signal {-p.returncode}"
    return True, f"the compile ended the process ({name}); XLA printed no message"
  out = p.stdout.strip().splitlines()
  last = out[-1] if out else ""
  if p.returncode == 0 and last == f"{_MARK} compiled":
    return False, ""
  why = last[len(_MARK) :].strip() if last.startswith(_MARK) else p.stderr.strip()[-300:]
  return None, why or f"exit status {p.returncode}"


def aborts(name: str) -> tuple[bool, str]:
  """Whether the installed XLA aborts compiling the programs the registry names for
  option ``name`` (set to the value it names), and how: on a jaxlib version the registry
  saw compile them, no; on any other, XLA's answer (asked once per jaxlib version), or,
  where XLA cannot be asked, the registry's record (aborts from the first version seen)."""
  from jax_overlap._src.flags.validation import version_tuple

  flag = REGISTRY[name]
  if flag.aborts is None:
    return False, ""
  installed = probe_lib.jaxlib_version()
  if installed in flag.aborts.clean_in:
    return False, ""
  with _answers.lock:
    _answers.load()
    if (name, installed) in _unasked:
      return _unasked[name, installed]
    if name not in _answers.entries:
      verdict, message = probe(name)
      if verdict is None:  # not asked: the registry's record
        record = (
          (False, "")
          if version_tuple(installed) < version_tuple(flag.aborts.since)
          else (True, f"{flag.aborts.check} (seen since jaxlib {flag.aborts.since}; {message})")
        )
        _unasked[name, installed] = record
        return record
      _answers.entries[name] = [verdict, message]
      _answers.save()
    verdict, message = _answers.entries[name]
  return bool(verdict), str(message)


def aborting(
  options: Mapping[str, Any], *, ask: Callable[[str], tuple[bool, str]] = aborts
) -> dict[str, str]:
  """The options of ``options`` set to a value with which the installed XLA aborts
  compiling some kind of program (``ask``: whether it does, :func:`aborts`):
  ``{name: XLA's message}``."""
  out = {}
  for name, value in options.items():
    flag = REGISTRY.get(name)
    if flag is None or flag.aborts is None or not _enables(flag, value):
      continue
    verdict, message = ask(name)
    if verdict:
      out[name] = message or flag.aborts.check
  return out


def program_kinds(lowered) -> frozenset[str]:
  """The :class:`.Abort` program kinds ``lowered`` (a ``jax.stages.Lowered`` or its text) is
  of."""
  return frozenset({"while_loop"} if "stablehlo.while" in _text(lowered) else ())


_WORDS = {"while_loop": "a program with a while loop (lax.scan, fori_loop, scanned layers)"}


def check_program(
  lowered, options: Mapping[str, Any], *, ask: Callable[[str], tuple[bool, str]] = aborts
) -> None:
  """Raises :class:`~jax_overlap.ConfigError` if compiling ``lowered`` with ``options``
  (and the options in ``XLA_FLAGS``) would make the installed XLA abort the process.
  Free when no option XLA is known to abort with is set."""
  given = {n: ("per compile", v) for n, v in options.items()}
  for name, value in syntax.parse_xla_flags(os.environ.get("XLA_FLAGS", ""))[0].items():
    given.setdefault(name, ("in XLA_FLAGS", value))
  candidates = {n: v for n, (_, v) in given.items() if REGISTRY.get(n) and REGISTRY[n].aborts}
  found = aborting(candidates, ask=ask) if candidates else {}
  text = lowered.as_text() if found else ""  # printed once, for both questions below
  if found:
    kinds = program_kinds(text)
    found = {n: why for n, why in found.items() if REGISTRY[n].aborts.programs in kinds}
  sized = {n for n in found if REGISTRY[n].aborts.up_to == "dot_operand_mib"}
  largest = 0
  if sized:
    largest = largest_dot_operand_bytes(text)
    for n in sized:  # XLA windows the dots at least the threshold's size: none here
      if not largest or float(syntax.format_value(candidates[n])) * (1 << 20) > largest:
        del found[n]
  if not found:
    return
  import jaxlib

  def which(n: str) -> str:
    if n not in sized:
      return ""
    return (
      " whose dots outside shard_map have an operand of at least that many MiB (the largest "
      f"here: {largest / (1 << 20):.1f} MiB)"
    )

  parts = [
    f"{n}={syntax.format_value(candidates[n])} "
    f"(set {given[n][0]}) makes jaxlib {jaxlib.__version__}'s XLA abort the process compiling "
    f"{_WORDS[REGISTRY[n].aborts.programs]}{which(n)}, and this program is one (XLA: {why})"
    for n, why in found.items()
  ]
  raise ConfigError(
    "; ".join(parts)
    + ". Compiling it would end this process rather than raise. Leave "
    + ("the option" if len(found) == 1 else "these options")
    + " unset (jax_overlap.flags.recommended() does on this jaxlib) or use a jaxlib without "
    "the bug."
  )
