"""Checking ``XLA_FLAGS`` strings and option dicts before XLA sees them.

:func:`validate` reads the string as XLA does (:mod:`.syntax`), asks the
installed jaxlib about every flag (:mod:`.probe`: XLA's own flag parser, in a
child process) and adds what the registry knows: removed and renamed flags
with their replacements, flags newer than the installed jaxlib, values that
work against overlap, and values outside a meaningful range. A problem of
severity ``"error"`` is exactly one that makes XLA abort the process at
backend start; ``"warning"`` marks what XLA accepts but is likely a mistake.

(Over 500 lines: one short function per kind of problem, each with the message a user
reads, beside the two readers of the input they check.)
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import re
from collections.abc import Mapping
from typing import Any, Literal

from jax_overlap._src.flags import aborts as aborts_lib
from jax_overlap._src.flags import probe as probe_lib
from jax_overlap._src.flags import syntax
from jax_overlap._src.flags.registry import ENTRIES, REGISTRY, Flag

__all__ = ["Problem", "validate", "accepted_by_jaxlib", "version_tuple"]

ProblemKind = Literal[
  "unknown",
  "removed",
  "renamed",
  "bad_value",
  "no_value",
  "malformed",
  "not_yet_supported",
  "counterproductive",
  "aborts",
  "conflict",
  "out_of_range",
  "ignored",
]


@dataclasses.dataclass(frozen=True)
class Problem:
  """One problem found by :func:`validate`.

  Attributes:
    name: the option or variable (or the offending text).
    kind: ``"unknown"``, ``"removed"``, ``"renamed"``, ``"bad_value"``,
      ``"no_value"`` (a bare ``--name`` of a non-bool flag), ``"malformed"``,
      ``"not_yet_supported"``, ``"counterproductive"``, ``"aborts"`` (XLA
      aborts compiling some programs with it: a warning), ``"conflict"`` (set
      twice to different values), ``"out_of_range"`` or ``"ignored"`` (text
      XLA skips without a word).
    message: what is wrong and what would be right.
    severity: ``"error"`` (XLA aborts the process on it) or ``"warning"``
      (XLA takes it, but it is likely a mistake or works against overlap).
    suggestion: the option to use instead, if any.
  """

  name: str
  kind: ProblemKind
  message: str
  severity: Literal["error", "warning"] = "error"
  suggestion: str | None = None

  def __str__(self) -> str:
    return f"{self.severity}: {self.message}"


def version_tuple(v: str) -> tuple[int, ...]:
  return tuple(int(p) for p in re.findall(r"\d+", v)[:3])


_ENV_PREFIXES = ("NCCL_", "CUDA_", "CUBLAS_", "CUDNN_")
_IN_XLA_FLAGS = "in XLA_FLAGS it aborts the process at backend start"
_PER_COMPILE = (
  "per compile, XLA refuses the compile with an error (in XLA_FLAGS it would abort the "
  "process at backend start)"
)
# What XLA does with a bad flag where the flags being checked go: XLA_FLAGS (a string) or
# one compile's options (a mapping).
_CONSEQUENCE: contextvars.ContextVar[str] = contextvars.ContextVar(
  "jax_overlap_flag_consequence", default=_IN_XLA_FLAGS
)
_TYPE_WORDS = {
  "bool": "a bool (true, false, 1 or 0)",
  "int32": "a base-10 int32",
  "int64": "a base-10 int64",
  "float": "a number",
  "string": "a string",
  "choice": "one of a fixed set of values",
}


def _registry_type(flag: Flag | None) -> str | None:
  if flag is None:
    return None
  return {"bool": "bool", "int": "int", "float": "float", "str": "string"}.get(flag.type)


def _xla_text(tok: syntax.Token) -> str:
  """The XLA_FLAGS value that hands XLA exactly this token."""
  assert tok.name is not None
  return f"--{tok.name}" if tok.value is None else syntax.format_token(tok.name, tok.value)


def validate(flags: str | Mapping[str, Any], *, probe: bool = True) -> list[Problem]:
  """Checks XLA options and NCCL/CUDA variables; never aborts the process.

  Args:
    flags: an ``XLA_FLAGS`` string, read exactly as XLA reads it (quotes,
      bare ``--name``, repeated flags, a flag-file name), or a dict of option
      (or environment variable) names to values, as for ``compiler_options=``
      (an enum's per-compile value, e.g. ``COLLECTIVE_PIPELINING_MODE_ON``, is read
      as the ``XLA_FLAGS`` value it stands for, ``on``).
    probe: ask the installed jaxlib how it reads each flag (XLA's own parser
      in a child process; cached per jaxlib version). With ``probe=False`` only
      the registry and XLA's syntax rules are consulted, and flags outside the
      registry are taken as they are.

  Returns:
    Every problem found, errors first. No error means XLA starts with these
    flags; warnings name what it takes but is likely a mistake.

  Raises:
    TypeError: if ``flags`` is neither a string nor a mapping.

  Example:
    >>> [p.kind for p in validate("--xla_gpu_enable_async_all_gather=true")]  # doctest: +SKIP
    ['removed']
  """
  token = _CONSEQUENCE.set(_IN_XLA_FLAGS if isinstance(flags, str) else _PER_COMPILE)
  try:
    return _validate(flags, probe)
  finally:
    _CONSEQUENCE.reset(token)


def _validate(flags: str | Mapping[str, Any], probe: bool) -> list[Problem]:
  problems: list[Problem] = []
  if isinstance(flags, str):
    tokens = _read_string(flags, problems)
  elif isinstance(flags, Mapping):
    tokens = _read_mapping(flags, problems)
  else:
    raise TypeError(
      "validate: flags must be an XLA_FLAGS string or a dict of option names to values, got "
      f"{type(flags).__name__}"
    )
  named = [t for t in tokens if t.name is not None]
  verdicts: dict[str, probe_lib.Verdict] = {}
  if probe and named:
    verdicts = probe_lib.judge(_xla_text(t) for t in named)
  seen: set[str] = set()
  for tok in named:
    key = _xla_text(tok)
    if key in seen:
      continue
    seen.add(key)
    if probe:
      problems.extend(_judged(tok, verdicts[key]))
    else:
      problems.extend(_from_registry(tok))
  problems.extend(_conflicts(named))
  problems.sort(key=lambda p: p.severity != "error")
  return problems


def _is_env(name: str) -> bool:
  flag = REGISTRY.get(name)
  return flag is not None and flag.kind == "env"


def _read_string(text: str, problems: list[Problem]) -> list[syntax.Token]:
  read = syntax.read_xla_flags(text)
  if read.file_error is not None:
    quoted = text.lstrip()[:1] in ("'", '"')
    hint = (
      "; it starts with a quote: remove the quotes (a shell keeps them when they sit inside "
      "another pair)"
      if quoted
      else ""
    )
    problems.append(
      Problem(
        text,
        "malformed",
        f"XLA_FLAGS does not start with '-', so XLA takes {text!r} as the name of a flag "
        f"file and cannot open it ({read.file_error}): {_CONSEQUENCE.get()}. Flags look like "
        f"--name=value{hint}",
      )
    )
  kept: list[syntax.Token] = []
  for i, tok in enumerate(read.tokens):
    if tok.text == "--":
      rest = " ".join(t.text for t in read.tokens[i + 1 :])
      problems.append(
        Problem(
          "--",
          "malformed",
          "'--' ends XLA's flag list: it and every flag after it"
          + (f" ({rest})" if rest else "")
          + f" count as unknown flags, and {_CONSEQUENCE.get()}",
        )
      )
      break
    if tok.name is None:
      problems.append(
        Problem(
          tok.text,
          "malformed",
          f"{tok.text!r} is not an XLA flag ({_CONSEQUENCE.get()}); XLA_FLAGS tokens look like "
          "--name=value (for example --xla_gpu_enable_latency_hiding_scheduler=true)",
        )
      )
    elif _is_env(tok.name):
      problems.append(
        Problem(
          tok.name,
          "unknown",
          f"{tok.name} is an environment variable, not an XLA flag: {_CONSEQUENCE.get()}. Set it in "
          f"the environment instead (export {tok.name}={tok.value or ''})",
        )
      )
    else:
      kept.append(tok)
  if read.ignored.strip():
    tail = read.ignored.strip()
    shown = tail if len(tail) <= 60 else tail[:57] + "..."
    problems.append(
      Problem(
        shown,
        "ignored",
        f"XLA stops reading XLA_FLAGS at {shown!r} (it does not start with '-') and ignores "
        "it and everything after it; write each flag as --name=value, and quote a value "
        'with blanks as --name="a b"',
        severity="warning",
      )
    )
  return kept


def _read_mapping(options: Mapping[Any, Any], problems: list[Problem]) -> list[syntax.Token]:
  tokens: list[syntax.Token] = []
  for k, v in options.items():
    if not isinstance(k, str) or not k.lstrip("-"):
      problems.append(
        Problem(str(k), "malformed", f"option names must be non-empty strings, got {k!r}")
      )
      continue
    name = k[2:] if k.startswith("--") else k
    flag = REGISTRY.get(name)
    if flag is not None and flag.kind == "env":
      problems.extend(_env_problems(flag, v))
      continue
    if flag is None and name.startswith(_ENV_PREFIXES):
      # NCCL and CUDA read many more variables than the registry knows (NCCL_DEBUG,
      # NCCL_IB_HCA ...): not XLA's to check, and nothing XLA aborts on.
      problems.append(
        Problem(
          name,
          "unknown",
          f"{name!r} is an environment variable jax_overlap does not know: not checked "
          "(set it in the environment; XLA does not read it)",
          severity="warning",
        )
      )
      continue
    if flag is None and not name.startswith("xla_"):
      problems.append(
        Problem(
          name,
          "unknown",
          f"{name!r} is neither an XLA option (they start with xla_) nor a known NCCL/CUDA "
          "variable",
        )
      )
      continue
    if not re.fullmatch(r"[A-Za-z0-9_]+", name):
      problems.append(
        Problem(name, "malformed", f"{name!r} is not an XLA option name ({_CONSEQUENCE.get()})")
      )
      continue
    if flag is not None and flag.proto_enum and isinstance(v, str):
      # A per-compile enum value (``<ENUM>_ON``) stands for XLA_FLAGS' short one (``on``).
      prefix = flag.proto_enum + "_"
      v = v[len(prefix) :].lower() if v.startswith(prefix) else v
    tokens.append(syntax.Token("", name, None if v is None else syntax.format_value(v)))
  return tokens


def _env_problems(flag: Flag, value: Any) -> list[Problem]:
  why = _value_problem(flag, syntax.format_value(value))
  if why:
    return [Problem(flag.name, "bad_value", f"{flag.name} {why}")]
  return _taken_problems(flag, syntax.format_value(value))


def _value_problem(flag: Flag, value: str | None) -> str | None:
  """Why ``value`` is wrong for a registry flag, by its registered type and choices."""
  rtype = _registry_type(flag)
  if rtype is not None:
    return syntax.value_error(rtype, value)
  if value is None:
    return syntax.value_error("string", None)
  if flag.type == "enum" and value not in flag.choices:
    return f"expects one of {', '.join(flag.choices)}, got {value!r}"
  if flag.type == "list" and flag.choices:
    items = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in items if x.lstrip("+-").upper() not in flag.choices]
    if bad:
      return f"expects a comma list of {', '.join(flag.choices)}; unknown item(s) {', '.join(bad)}"
  return None


def _from_registry(tok: syntax.Token) -> list[Problem]:
  """Problems of one token from the registry and XLA's syntax alone (no jaxlib)."""
  flag = REGISTRY.get(tok.name)
  if flag is None:
    return []
  version = version_tuple(probe_lib.jaxlib_version())
  if flag.removed_in and version >= version_tuple(flag.removed_in):
    return [_removed_problem(flag)]
  if flag.since and version < version_tuple(flag.since):
    return [_not_yet(flag)]
  why = _value_problem(flag, tok.value)
  if why:
    kind = "no_value" if tok.value is None else "bad_value"
    return [Problem(tok.name, kind, f"{tok.name} {why}; {_CONSEQUENCE.get()}")]
  return _taken_problems(flag, tok.value)


def _judged(tok: syntax.Token, verdict: probe_lib.Verdict) -> list[Problem]:
  """Problems of one token, given what the installed jaxlib does with it."""
  name = tok.name
  flag = REGISTRY.get(name)
  if verdict.accepted:
    if flag is None:
      return []
    return _taken_problems(flag, tok.value)
  if verdict.reason == "unknown":
    ftype = probe_lib.flag_type(name) if tok.bare else None
    if ftype is not None:
      return [
        Problem(
          name,
          "no_value",
          f"--{name} has no value: XLA reads a bare --name as true for bool flags only, "
          f"and {name} takes {_TYPE_WORDS[ftype]}, so XLA does not recognise the token and "
          f"{_CONSEQUENCE.get()}; write --{name}=<value>",
        )
      ]
    if flag is not None and flag.removed_in:
      return [_removed_problem(flag)]
    if flag is not None and flag.since:
      return [_not_yet(flag)]
    if flag is not None and flag.replacement:
      return [
        Problem(
          name,
          "renamed",
          f"{name} is not accepted by jaxlib {probe_lib.jaxlib_version()}; use "
          f"{flag.replacement} instead",
          suggestion=flag.replacement,
        )
      ]
    close = close_name(name)
    hint = f"; did you mean {close}?" if close else ""
    return [
      Problem(
        name,
        "unknown",
        f"{name} is not an option of jaxlib {probe_lib.jaxlib_version()}: {_CONSEQUENCE.get()}{hint}",
        suggestion=close,
      )
    ]
  if verdict.reason == "bad_value":
    ftype = probe_lib.flag_type(name)
    takes = f"; it takes {_TYPE_WORDS[ftype]}" if ftype else ""
    if flag is not None and flag.choices:
      takes += f" ({', '.join(flag.choices)})"
    return [
      Problem(
        name,
        "bad_value",
        f"{name}={tok.value!r} is rejected by XLA ({verdict.message}){takes}: {_CONSEQUENCE.get()}",
      )
    ]
  return [Problem(name, "bad_value", f"--{name}: XLA fails to start with it ({verdict.message})")]


def _removed_problem(flag: Flag) -> Problem:
  hint = f"; use {flag.replacement} instead" if flag.replacement else ""
  return Problem(
    flag.name,
    "renamed" if flag.replacement else "removed",
    f"{flag.name} was removed from XLA (jaxlib {probe_lib.jaxlib_version()} does not know it; "
    f"{_CONSEQUENCE.get()}){hint}. {flag.why}".strip(),
    suggestion=flag.replacement,
  )


def _not_yet(flag: Flag) -> Problem:
  older = [f.name for f in ENTRIES if f.replacement == flag.name]
  hint = f"; this jaxlib spells it {older[0]}" if older else ""
  return Problem(
    flag.name,
    "not_yet_supported",
    f"{flag.name} needs jaxlib >= {flag.since}, installed {probe_lib.jaxlib_version()}{hint}",
    suggestion=older[0] if older else None,
  )


def _taken_problems(flag: Flag, value: str | None) -> list[Problem]:
  """Problems of a value XLA takes: it works against overlap, is out of range, or makes
  the installed XLA abort some compiles."""
  return _counterproductive(flag, value) + _out_of_range(flag, value) + _aborting(flag, value)


def _aborting(flag: Flag, value: str | None) -> list[Problem]:
  if flag.aborts is None:
    return []
  found = aborts_lib.aborting({flag.name: value})
  if not found:
    return []
  shown = "true" if value is None else value
  whose = (
    f" whose dots have an operand of at least {shown} MiB"
    if flag.aborts.up_to == "dot_operand_mib"
    else ""
  )
  return [
    Problem(
      flag.name,
      "aborts",
      f"{flag.name}={shown} makes jaxlib {probe_lib.jaxlib_version()}'s XLA abort the process "
      f"compiling programs with a while loop (lax.scan, fori_loop, scanned layers){whose}: "
      f"{found[flag.name]}; leave it unset",
      severity="warning",
    )
  ]


def _counterproductive(flag: Flag, value: Any) -> list[Problem]:
  s = "true" if value is None else syntax.format_value(value).strip().lower()
  if flag.name == "xla_gpu_enable_highest_priority_async_stream" and s in ("false", "0"):
    return [
      Problem(
        flag.name,
        "counterproductive",
        f"{flag.name}=false puts collectives on normal-priority streams: compute blocks "
        "then take the SMs first and communication waits (the priority control is off)",
        severity="warning",
      )
    ]
  if flag.name == "CUDA_DEVICE_MAX_CONNECTIONS" and s == "1":
    return [
      Problem(
        flag.name,
        "counterproductive",
        "CUDA_DEVICE_MAX_CONNECTIONS=1 gives the device one hardware queue: kernels reach "
        "the GPU in the order the host launched them, whatever their stream's priority, so "
        "a collective XLA launches after a compute kernel waits until all of that kernel's "
        "blocks are placed (behind a persistent cuBLAS GEMM on Hopper, until it ends); "
        "only collectives launched first still overlap "
        "(jax_overlap.flags.judge_environment(report) simulates it on your step)",
        severity="warning",
      )
    ]
  return []


def _out_of_range(flag: Flag, value: str | None) -> list[Problem]:
  if flag.minimum is None or value is None:
    return []
  try:
    number = float(value)
  except ValueError:
    return []
  if number >= flag.minimum:
    return []
  return [
    Problem(
      flag.name,
      "out_of_range",
      f"{flag.name}={value.strip()} is below {flag.minimum:g}: XLA takes it, but the option "
      f"({flag.meaning.rstrip('.')}) is meant for values >= {flag.minimum:g}",
      severity="warning",
    )
  ]


def _same(a: str | None, b: str | None) -> bool:
  bools = {"true": True, "1": True, "false": False, "0": False}
  a_, b_ = ("true" if a is None else a), ("true" if b is None else b)
  if a_.lower() in bools and b_.lower() in bools:
    return bools[a_.lower()] == bools[b_.lower()]
  if re.fullmatch(r"\s*[+-]?\d+\s*", a_) and re.fullmatch(r"\s*[+-]?\d+\s*", b_):
    return int(a_) == int(b_)
  return a_ == b_


def _conflicts(tokens: list[syntax.Token]) -> list[Problem]:
  by_name: dict[str, list[str | None]] = {}
  for t in tokens:
    by_name.setdefault(t.name, []).append(t.value)
  out = []
  for name, values in by_name.items():
    if len(values) > 1 and not all(_same(values[0], v) for v in values[1:]):
      shown = ", ".join("(bare)" if v is None else repr(v) for v in values)
      last = "(bare)" if values[-1] is None else repr(values[-1])
      out.append(
        Problem(
          name,
          "conflict",
          f"{name} is set {len(values)} times with different values ({shown}); XLA applies "
          f"them in order, so the last one, {last}, wins",
          severity="warning",
        )
      )
  return out


def close_name(name: str) -> str | None:
  """The registered XLA option closest to ``name`` (a likely misspelling), if any."""
  known = [f.name for f in ENTRIES if f.kind == "xla" and not f.removed_in]
  match = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
  return match[0] if match else None


def accepted_by_jaxlib(name: str, value: Any = None) -> bool:
  """Whether the installed jaxlib takes ``--name=value`` in ``XLA_FLAGS``.

  Without a value: whether it knows the flag at all.
  """
  if value is None:
    return probe_lib.flag_type(name) is not None
  token = syntax.format_token(name, value)
  return probe_lib.judge([token])[token].accepted
