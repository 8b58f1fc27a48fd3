"""Asking the installed jaxlib what it does with an ``XLA_FLAGS`` value.

XLA reads ``XLA_FLAGS`` when the first backend starts and aborts the process
on a flag it cannot take. The only exact answer to "would this abort?" is
XLA's own flag parser, so this module asks it: a short helper process imports
jaxlib once, then for each value forks a child that sets ``XLA_FLAGS`` and
starts a CPU client. The child's exit status and its log lines are the
verdict (about 15 ms a value after a 1 s start). The caller's process never
starts a backend and never sees an abort. Verdicts are cached per jaxlib
version, in memory and under the jax_overlap cache directory.

Where ``os.fork`` is missing the helper starts one process per value instead.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable
from typing import Literal

from jax_overlap._src import cache as cache_lib
from jax_overlap._src.errors import ConfigError

__all__ = ["Verdict", "Answers", "judge", "flag_type", "jaxlib_version", "FlagType"]

FlagType = Literal["bool", "int32", "int64", "float", "string", "choice"]

# Runs in the helper process: each stdin line is a JSON list of XLA_FLAGS values,
# answered by one stdout line.
_HELPER = r"""
import json, os, subprocess, sys
try:
  from jax._src.lib import xla_client
  start = xla_client.make_cpu_client
except Exception:  # a jax without that entry point
  import jax
  start = lambda: jax.devices("cpu")
START = ("from jax._src.lib import xla_client; xla_client.make_cpu_client()")

def forked(value):
  r, w = os.pipe()
  pid = os.fork()
  if pid == 0:
    os.close(r)
    os.dup2(w, 1)
    os.dup2(w, 2)
    os.environ["XLA_FLAGS"] = value
    try:
      start()
    except BaseException as e:
      os.write(2, ("python: " + repr(e)).encode())
      os._exit(3)
    os._exit(0)
  os.close(w)
  out = []
  while True:
    chunk = os.read(r, 1 << 16)
    if not chunk:
      break
    out.append(chunk)
  os.close(r)
  _, status = os.waitpid(pid, 0)
  return os.waitstatus_to_exitcode(status), b"".join(out).decode(errors="replace")

def spawned(value):
  env = dict(os.environ, XLA_FLAGS=value)
  p = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True, text=True)
  return p.returncode, p.stdout + p.stderr

run = forked if hasattr(os, "fork") else spawned
for line in sys.stdin:
  answers = {}
  for v in json.loads(line):
    code, text = run(v)
    answers[v] = [code, text.split("usage:", 1)[0][:6000]]
  sys.stdout.write("JAX_OVERLAP_PROBE" + json.dumps(answers) + "\n")
  sys.stdout.flush()
"""

_MARK = "JAX_OVERLAP_PROBE"
_LOG_PREFIX = re.compile(r"^[EFWI]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] ")


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What the installed jaxlib does with one ``XLA_FLAGS`` value.

  Attributes:
    accepted: XLA started with it.
    reason: ``"ok"``; ``"unknown"`` (a flag XLA does not know, or a bare
      ``--name`` of a non-bool flag); ``"bad_value"`` (XLA knows the flag and
      rejects the value); ``"file"`` (taken as a flag file that cannot be
      opened); ``"other"`` (any other failure).
    message: XLA's own words (its first error line), or "".
  """

  accepted: bool
  reason: Literal["ok", "unknown", "bad_value", "file", "other"]
  message: str = ""


def jaxlib_version() -> str:
  import jaxlib

  return jaxlib.__version__


def _verdict(code: int, output: str) -> Verdict:
  if code == 0:
    return Verdict(True, "ok")
  output = output.split("usage:", 1)[0]  # the flag list XLA prints after the error
  lines = [_LOG_PREFIX.sub("", ln).strip() for ln in output.splitlines()]
  lines = [ln for ln in lines if ln]
  text = "\n".join(lines)
  if "Unknown flag" in text:
    reason = "unknown"
  elif "Could not open file" in text:
    reason = "file"
  elif "Flag parsing failed" in text or "Illegal value" in text or "Couldn't interpret" in text:
    reason = "bad_value"
  else:
    reason = "other"
  first = next(
    (ln for ln in lines if "Check failed" not in ln and "Flag parsing failed" not in ln),
    "XLA's flag parser rejects the value" if lines else f"exit status {code}",
  )
  return Verdict(False, reason, first[:400])


class Answers:
  """What the installed jaxlib answered, by question: in memory, and in one JSON file per
  jaxlib version under the jax_overlap cache directory (``<stem>-jaxlib-<version>.json``).
  Each answer is a JSON list of ``width`` items."""

  def __init__(self, stem: str, width: int):
    self.stem, self.width = stem, width
    self.lock = threading.Lock()
    self.entries: dict[str, list] = {}
    self._loaded: set[str] = set()

  def _path(self) -> str:
    return os.path.join(cache_lib.cache_dir(), f"{self.stem}-jaxlib-{jaxlib_version()}.json")

  def load(self) -> None:
    """Reads the file of this jaxlib version once (call with ``lock`` held)."""
    path = self._path()
    if path in self._loaded:
      return
    self._loaded.add(path)
    try:
      with open(path) as f:
        data = json.load(f)
    except (OSError, ValueError):
      return
    if isinstance(data, dict):
      for k, v in data.items():
        if isinstance(v, list) and len(v) == self.width:
          self.entries.setdefault(k, v)

  def save(self) -> None:
    try:
      cache_lib.write_text(self._path(), json.dumps(self.entries, indent=0, sort_keys=True))
    except OSError:
      pass


_answers = Answers("xla_flags", 3)


class _Helper:
  """The helper process, started on first use and kept for the life of this one."""

  def __init__(self):
    self.proc: subprocess.Popen | None = None

  def ask(self, values: list[str]) -> dict[str, list]:
    for attempt in (0, 1):
      if self.proc is None or self.proc.poll() is not None:
        self.proc = self._start()
      try:
        self.proc.stdin.write(json.dumps(values) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
      except OSError:
        line = ""
      if line.startswith(_MARK):
        return json.loads(line[len(_MARK) :])
      err = self._stop()
      if attempt:
        raise ConfigError(f"flags: the jaxlib flag probe failed: {err.strip()[-600:]}")
    raise AssertionError("unreachable")

  @staticmethod
  def _start() -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LD_PRELOAD")}
    env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_MAX_VLOG_LEVEL="0")
    try:
      return subprocess.Popen(
        [sys.executable, "-c", _HELPER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=tempfile.TemporaryFile(),  # read only when the helper fails
        text=True,
        env=env,
      )
    except OSError as e:
      raise ConfigError(f"flags: could not ask jaxlib how it reads XLA_FLAGS: {e}") from e

  def _stop(self) -> str:
    """Ends the helper; returns what it wrote to stderr."""
    proc, self.proc = self.proc, None
    if proc is None:
      return ""
    try:
      proc.communicate(timeout=10)
    except (subprocess.TimeoutExpired, OSError, ValueError):
      proc.kill()
      proc.wait()
    err = proc.stderr
    proc.stderr = None
    try:
      err.seek(0)
      text = err.read().decode(errors="replace")
    except (AttributeError, OSError, ValueError):
      text = ""
    return text or f"exit status {proc.returncode}"


_helper = _Helper()
atexit.register(_helper._stop)


def judge(values: Iterable[str]) -> dict[str, Verdict]:
  """Runs each ``XLA_FLAGS`` value through the installed jaxlib's flag parser.

  Args:
    values: whole ``XLA_FLAGS`` values (one flag each, usually).

  Returns:
    ``{value: Verdict}``.

  Raises:
    ConfigError: if the helper process cannot run at all.
  """
  values = list(dict.fromkeys(values))
  with _answers.lock:
    _answers.load()
    todo = [v for v in values if v not in _answers.entries]
    if todo:
      for v, (code, output) in _helper.ask(todo).items():
        verdict = _verdict(code, output)
        _answers.entries[v] = [verdict.accepted, verdict.reason, verdict.message]
      _answers.save()
    return {v: Verdict(bool(a), r, m) for v in values for a, r, m in [_answers.entries[v]]}


def flag_type(name: str) -> FlagType | None:
  """The type XLA's flag parser gives ``name``; None if jaxlib does not know it.

  Read from XLA by the values it takes: a bare ``--name`` only for bools;
  ``0.5`` for floats (and strings); ``7`` but not ``0.5`` for integers, and
  ``3000000000`` only for int64; anything for plain strings. A flag that takes
  none of ``7``, ``0.5`` and ``zz`` is a string with fixed choices (an enum or
  a list checked by XLA).
  """
  probes = {
    "bare": f"--{name}",
    "empty": f"--{name}=",
    "half": f"--{name}=0.5",
    "seven": f"--{name}=7",
    "big": f"--{name}=3000000000",
    "word": f"--{name}=zz",
  }
  got = judge(probes.values())
  ok = {k: got[v].accepted for k, v in probes.items()}
  if all(got[v].reason == "unknown" for v in probes.values()):
    return None
  if ok["bare"]:
    return "bool"
  if ok["word"]:
    return "string"
  if ok["half"]:
    return "float"
  if ok["seven"]:
    return "int64" if ok["big"] else "int32"
  return "choice"
