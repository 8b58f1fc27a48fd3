"""XLA's profile-guided scheduling warnings, kept off the user's stderr and summarised.

A compile scheduled from a latency profile (``xla_gpu_pgle_profile_file_or_directory_path``)
makes XLA print, from ``profile_guided_latency_estimator.cc``, how many of the profile's
instructions it found and the name of every one it costs itself because the profile does not
name it. Instruction names are not stable from one compile of a program to the next: the
GEMM custom-calls XLA creates (``custom-call.N``) are numbered by what the process compiled
before, so a profile written from one compile can miss a few of another's. Those lines are
XLA's, one per instruction (a page of them on a large step); :func:`quiet` takes them out
of stderr while a compile runs (everything else XLA or Python prints goes through, once the
compile is over) and :func:`summary` says in one sentence what they said.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import threading

__all__ = ["PROFILE_OPTION", "ProfileLookups", "quiet", "quiet_if_profiled", "summary"]

# The per-compile option naming a latency profile (``latency_profile.OPTION``).
PROFILE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"

_SOURCE = "profile_guided_latency_estimator.cc"
_FOUND = re.compile(r"Found (\d+) instructions from the profile")
_MISSING = re.compile(r"Missing (\d+) instructions from the profile")
_NAME = re.compile(r"\]\s+(\S+)\s*$")


@dataclasses.dataclass
class ProfileLookups:
  """What XLA said of the latency profiles of the compiles under :func:`quiet`."""

  found: int = 0
  missing: list[str] = dataclasses.field(default_factory=list)
  lines: int = 0  # XLA's lines taken out of stderr


_lock = threading.Lock()
_depth = 0
_saved_fd: int | None = None
_capture = None
_read_at = 0
_partial = b""
_listeners: list[ProfileLookups] = []


@contextlib.contextmanager
def quiet():
  """Within: XLA's latency-profile lines go to the :class:`ProfileLookups` yielded, not to
  stderr; every other line written to file descriptor 2 goes to stderr when a ``quiet``
  ends. Safe to nest and to enter from several threads (compiles running at once share
  one capture; each ``quiet`` receives the profile lines written while it was open).
  Where file descriptor 2 cannot be redirected, nothing is taken out."""
  global _depth, _saved_fd, _capture, _read_at, _partial
  lookups = ProfileLookups()
  with _lock:
    if _depth == 0:
      try:
        sys.stderr.flush()
        capture = tempfile.TemporaryFile()
        saved = os.dup(2)
        os.dup2(capture.fileno(), 2)
      except (OSError, ValueError, AttributeError):
        capture, saved = None, None
      _capture, _saved_fd, _read_at, _partial = capture, saved, 0, b""
    elif _capture is not None:
      _drain(restore=False)  # what came before is the open ones' alone
    _depth += 1
    _listeners.append(lookups)
  try:
    yield lookups
  finally:
    with _lock:
      _depth -= 1
      last = _depth == 0
      if _capture is not None:
        _drain(restore=last)
      _listeners.remove(lookups)


def quiet_if_profiled(options):
  """:func:`quiet` for a compile scheduled from a latency profile (``options`` name one);
  a context yielding an empty record otherwise."""
  if options.get(PROFILE_OPTION):
    return quiet()
  return contextlib.nullcontext(ProfileLookups())


def _drain(restore: bool) -> None:
  """Hands what was written to the capture since the last drain on: the latency-profile
  lines to the open listeners, the rest to the real stderr; with ``restore``, the
  real stderr back on file descriptor 2 (the unfinished last line with it)."""
  global _saved_fd, _capture, _read_at, _partial
  try:
    sys.stderr.flush()
  except (OSError, ValueError, AttributeError):
    pass
  if restore:
    os.dup2(_saved_fd, 2)
  data = _partial + os.pread(_capture.fileno(), 1 << 30, _read_at)
  _read_at += len(data) - len(_partial)
  before, newline, after = data.rpartition(b"\n")
  complete, _partial = (data, b"") if restore else (before + newline, after)
  kept, lookups = _split(complete.decode("utf-8", errors="replace"))
  for listener in _listeners:
    listener.found += lookups.found
    listener.missing.extend(lookups.missing)
    listener.lines += lookups.lines
  if kept:
    os.write(_saved_fd if not restore else 2, kept.encode("utf-8"))
  if restore:
    os.close(_saved_fd)
    _capture.close()
    _capture, _saved_fd = None, None


def _split(text: str) -> tuple[str, ProfileLookups]:
  """(the lines of ``text`` that are not XLA's latency-profile lines, what those said)."""
  kept, out = [], ProfileLookups()
  for line in text.splitlines(keepends=True):
    if _SOURCE not in line:
      kept.append(line)
      continue
    out.lines += 1
    if m := _FOUND.search(line):
      out.found += int(m.group(1))
    elif _MISSING.search(line):
      pass
    elif m := _NAME.search(line):
      out.missing.append(m.group(1))
  return "".join(kept), out


def summary(lookups: ProfileLookups, most: int = 8) -> str | None:
  """One sentence for ``explain()`` / a report's notes (None when XLA said nothing)."""
  if not lookups.lines:
    return None
  if not lookups.missing:
    return (
      f"XLA's scheduler found every instruction it costs in the latency profile "
      f"({lookups.found} looked up)"
    )
  names = sorted(set(lookups.missing))
  shown = ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
  return (
    f"XLA's scheduler costed {len(names)} instruction(s) itself that the latency profile "
    f"does not name ({shown}; {lookups.found} found in it): XLA numbers the GEMM "
    "custom-calls it creates by what the process compiled before, so a profile written "
    f"from one compile can miss another's; its {lookups.lines} warning line(s) were kept "
    "off stderr"
  )
