"""How XLA reads ``XLA_FLAGS``: its tokenizer and its value syntax, in Python.

XLA (``xla/parse_flags_from_env.cc``) reads the variable once per process:

* If its first non-blank character is not ``-``, the whole value is a file
  name whose contents hold the flags; a file that cannot be opened aborts the
  process (an all-blank value included).
* Otherwise tokens are read while they start with ``-``. A token runs to the
  next blank (space, tab, CR, LF), except ``--name="..."`` and ``--name='...'``,
  whose quotes are removed (inside double quotes a backslash escapes the next
  character; inside single quotes nothing is special; an unclosed quote runs
  to the end). The first token that does not start with ``-`` ends the
  reading: it and everything after it are ignored without a word.

Each token is then matched against the registered flags
(``xla/tsl/util/command_line_flags.cc``): ``--name=value`` for every type, a
bare ``--name`` only for bools (for other types it matches nothing and aborts
as an unknown flag), ``--`` sends itself and the rest to the unknown list.
Bools take ``true``/``false`` in any case or ``1``/``0``; integers base 10 with
an optional sign and surrounding blanks, without overflow; floats in decimal
or ``inf``/``nan`` notation. Every occurrence of a flag is applied in order, so
the last one wins. This module mirrors those rules; the installed jaxlib stays
the judge (:mod:`jax_overlap._src.flags.probe`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = [
  "Token",
  "XlaFlagsText",
  "read_xla_flags",
  "parse_xla_flags",
  "format_value",
  "format_token",
  "format_xla_flags",
  "value_error",
]

_BLANK = " \t\r\n"
_NAME_CHARS = re.compile(r"[-_A-Za-z0-9]*")
_FLAG = re.compile(r"--(?P<name>[A-Za-z0-9_]+)(?:=(?P<value>.*))?", re.S)


@dataclasses.dataclass(frozen=True)
class Token:
  """One argument as XLA cuts it from ``XLA_FLAGS``.

  Attributes:
    text: the argument XLA hands to its flag parser (quotes removed).
    name: the flag name when the argument has the ``--name[=value]`` shape, else None.
    value: the value after ``=``; None for a bare ``--name``.
  """

  text: str
  name: str | None
  value: str | None

  @property
  def bare(self) -> bool:
    return self.name is not None and self.value is None


@dataclasses.dataclass(frozen=True)
class XlaFlagsText:
  """An ``XLA_FLAGS`` value as XLA reads it.

  Attributes:
    tokens: the arguments, in order.
    ignored: the text XLA skips without a word (from the first token that
      does not start with ``-``), or "".
    flag_file: the file name XLA takes the value for, when it does not start
      with ``-``; None otherwise.
    file_error: why that file cannot be read (XLA then aborts), or None.
  """

  tokens: tuple[Token, ...]
  ignored: str = ""
  flag_file: str | None = None
  file_error: str | None = None


def _token(text: str) -> Token:
  m = _FLAG.fullmatch(text)
  if m is None:
    return Token(text, None, None)
  return Token(text, m.group("name"), m.group("value"))


def _split(text: str) -> tuple[list[Token], str]:
  tokens: list[Token] = []
  n = len(text)
  b = _skip_blanks(text, 0)
  while b < n and text[b] == "-":
    e = _NAME_CHARS.match(text, b).end()
    if e < n - 1 and text[e] == "=" and text[e + 1] in "'\"":
      head = text[b : e + 1]  # through the '='
      quote = text[e + 1]
      value = []
      e += 2
      while e < n and text[e] != quote:
        c = text[e]
        if quote == '"' and c == "\\" and e + 1 < n:
          e += 1
          c = text[e]
        value.append(c)
        e += 1
      if e < n:
        e += 1  # the closing quote
      tokens.append(_token(head + "".join(value)))
    else:
      while e < n and text[e] not in _BLANK:
        e += 1
      tokens.append(_token(text[b:e]))
    b = _skip_blanks(text, e)
  return tokens, text[b:]


def _skip_blanks(text: str, i: int) -> int:
  while i < len(text) and text[i] in _BLANK:
    i += 1
  return i


def read_xla_flags(text: str) -> XlaFlagsText:
  """Reads an ``XLA_FLAGS`` value exactly as XLA does (see the module docstring).

  A value that does not start with ``-`` names a flag file: it is read here
  as XLA would read it (relative to the current directory).

  Raises:
    TypeError: if ``text`` is not a string.
  """
  if not isinstance(text, str):
    raise TypeError(f"read_xla_flags: expected an XLA_FLAGS string, got {type(text).__name__}")
  if text == "":
    return XlaFlagsText(())
  if text[_skip_blanks(text, 0) :][:1] == "-":
    tokens, ignored = _split(text)
    return XlaFlagsText(tuple(tokens), ignored)
  try:
    if os.path.isdir(text):
      contents = ""  # fopen succeeds on a directory and fread reads nothing
    else:
      with open(text, encoding="utf-8", errors="surrogateescape") as f:
        contents = f.read()
  except OSError as e:
    return XlaFlagsText((), flag_file=text, file_error=e.strerror or str(e))
  tokens, ignored = _split(contents)
  return XlaFlagsText(tuple(tokens), ignored, flag_file=text)


def parse_xla_flags(text: str) -> tuple[dict[str, str], list[str]]:
  """Splits an ``XLA_FLAGS`` string into ``{name: value}`` and a list of bad pieces.

  Tokens are cut as XLA cuts them; a repeated flag keeps its last value, as in
  XLA. A bare ``--name`` maps to ``"true"`` (XLA's reading for bool flags;
  :func:`jax_overlap.flags.validate` says when the flag is not a bool). Bad
  pieces are arguments that are not ``--name[=value]`` and any text XLA would
  ignore.
  """
  read = read_xla_flags(text)
  out: dict[str, str] = {}
  bad: list[str] = []
  if read.file_error:
    bad.append(read.flag_file or text)
  for tok in read.tokens:
    if tok.name is None:
      bad.append(tok.text)
    else:
      out[tok.name] = "true" if tok.value is None else tok.value
  if read.ignored.strip():
    bad.append(read.ignored.strip())
  return out, bad


def format_value(v: Any) -> str:
  """A Python value as XLA_FLAGS spells it (bools as true/false)."""
  if isinstance(v, bool):
    return "true" if v else "false"
  return str(v)


def format_token(name: str, value: Any) -> str:
  """``--name=value``, quoted the way XLA's tokenizer unquotes it when needed."""
  s = format_value(value)
  if any(c in s for c in _BLANK + "'\"\\"):
    s = '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
  return f"--{name}={s}"


def format_xla_flags(options: Mapping[str, Any]) -> str:
  """Formats ``{name: value}`` as an ``XLA_FLAGS`` string that XLA reads back unchanged."""
  return " ".join(format_token(k, v) for k, v in options.items())


# ---------------------------------------------------------------------------
# Values, by type, as tsl's flag parser reads them.
# ---------------------------------------------------------------------------

_INT = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+[ \t\n\v\f\r]*")
_FLOAT = re.compile(
  r"[ \t\n\v\f\r]*\+?-?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf(?:inity)?|nan)"
  r"[ \t\n\v\f\r]*",
  re.I,
)
_INT_RANGE = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


def value_error(type_: str, value: str | None) -> str | None:
  """Why XLA's flag parser rejects ``value`` for a flag of ``type_``, or None.

  Args:
    type_: ``"bool"``, ``"int32"``, ``"int64"``, ``"int"`` (either width),
      ``"float"`` or ``"string"``; other types (enums, lists) are judged by
      the installed jaxlib, and only a missing value is caught here.
    value: the text after ``=``; None for a bare ``--name``.
  """
  if value is None:
    if type_ == "bool":
      return None
    return "has no value: a bare --name is read as true for bool flags only"
  if type_ == "bool":
    if value.lower() in ("true", "false") or value in ("1", "0"):
      return None
    return f"expects true, false, 1 or 0, got {value!r}"
  if type_ in ("int", "int32", "int64"):
    if not _INT.fullmatch(value):
      return f"expects a base-10 integer, got {value!r}"
    lo, hi = _INT_RANGE["int32" if type_ == "int32" else "int64"]
    if not lo <= int(value) <= hi:
      return f"{value.strip()} does not fit in {'an int32' if type_ == 'int32' else 'an int64'}"
    return None
  if type_ == "float":
    if _FLOAT.fullmatch(value) and not value.strip().startswith("+-"):
      return None
    return f"expects a number, got {value!r}"
  return None
