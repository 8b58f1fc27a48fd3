"""One choice of variant per job: in a multi-process run, process 0 chooses and the others
take its choice.

``@overlap`` chooses among its variants from a selection cache on disk, deviceless
compiles and the cost model. Each process has its own disk and its own compiles, so under
``jax.distributed`` two hosts could choose differently (an older entry in one cache, a
variant that failed to compile on one host) and run different programs: collectives that
do not match, and a hang with no error. Here, when ``jax.process_count() > 1``:

- Process 0 chooses as a single process would (its own selection cache, its compiles)
  and publishes the choice in JAX's distributed key-value store
  (``jax._src.distributed.global_state.client``): the variant's name, the name it is
  rebuilt from, its XLA options, the estimates, the failures and notes, and the text of
  the latency profile it was scheduled with, if the selection wrote one.
- The other processes neither read their own selection cache nor compile the variants:
  they wait for process 0's choice (a blocking read, so it does not matter which process
  arrives first) and rebuild that variant from their own list of variants. At scale this
  saves every host but one the selection's compiles; the chosen variant is compiled where
  it runs, as any ``jax.jit`` step is.
- Every process then confirms: one that cannot use the choice (process 0's variant is not
  among its own, process 0's selection failed) writes its error under the build's key, and
  all meet at a barrier; after it each process reads the errors, so all of them stop with
  the same RuntimeError naming the process and both choices, instead of one process
  stopping and the others waiting in a collective.

Keys: ``jax_overlap/choice/<fingerprint>/<n>``, where the fingerprint is the selection
cache's key of the build (the traced program, the arguments' shapes, dtypes and shardings,
the settings, jax and jax_overlap's code), the same on every process running the same
step, and ``n`` counts this process's builds with that fingerprint (the same step built
twice in one job gets two keys; several decorated steps get keys of their own). Every
process must build each step (call it, or ``lower``/``trace``/``explain`` it) in the same
order, as every process must run each multi-process computation.

Every wait is bounded: ``$JAX_OVERLAP_CHOICE_TIMEOUT_S`` seconds (default
:data:`DEFAULT_TIMEOUT_S`) from the start of the build (for process 0, from its
publishing), after which a RuntimeError says what was waited for.

Example (what the pipeline's select step does, in order)::

  agreement = shared_choice.begin(program_text, signature, settings_key)
  if shared_choice.follows(agreement):
    choice = shared_choice.receive(agreement, candidates)  # no compiles here
  ...  # process 0 (or a single process) chooses as before
  shared_choice.settle(agreement, choice, notes)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import os
import re
import tempfile
import threading
import time
from typing import Any

import jax

from jax_overlap._src import cache
from jax_overlap._src.analysis import latency_profile
from jax_overlap._src.transform import selection_cache
from jax_overlap._src.transform.records import Candidate, Choice, Estimate
from jax_overlap._src.transform.variants import CONVERTED_PREFIX, PROFILED_SUFFIX

__all__ = [
  "DEFAULT_TIMEOUT_S",
  "TIMEOUT_ENV",
  "Agreement",
  "begin",
  "follows",
  "receive",
  "reports_failures",
  "settle",
  "timeout_s",
]

TIMEOUT_ENV = "JAX_OVERLAP_CHOICE_TIMEOUT_S"
# Process 0's selection compiles take tens of seconds on a large model; the others wait
# that long for its choice.
DEFAULT_TIMEOUT_S = 600.0
PREFIX = "jax_overlap/choice/"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")

_lock = threading.Lock()
_builds: collections.Counter = collections.Counter()
_open = threading.local()


def timeout_s() -> float:
  """Seconds a process waits for the others at one build (``$JAX_OVERLAP_CHOICE_TIMEOUT_S``).

  Raises:
    ValueError: the variable is set to something other than a positive number.
  """
  env = os.environ.get(TIMEOUT_ENV)
  if env is None:
    return DEFAULT_TIMEOUT_S
  try:
    value = float(env)
  except ValueError:
    value = -1.0
  if not value > 0 or value == float("inf"):
    raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {env!r}")
  return value


def _process() -> tuple[int, int]:
  """This process's index and the number of processes (a function so tests can replace it)."""
  return jax.process_index(), jax.process_count()


def _client():
  """JAX's distributed runtime client (a module-level function so tests can replace it)."""
  from jax._src import distributed

  return distributed.global_state.client


@dataclasses.dataclass
class Agreement:
  """One build's agreement on a variant across the job's processes.

  Attributes:
    key: the build's key in the key-value store.
    process / processes: this process's index and the number of processes.
    deadline: ``time.monotonic()`` after which this process stops waiting.
    timeout_s: the seconds it waits (:func:`timeout_s`).
    published / settled: process 0 has published its choice (or its error); this process
      has confirmed (or reported its error).
    shared: the choice as process 0 published it (the other processes, once received).
  """

  key: str
  process: int
  processes: int
  deadline: float
  timeout_s: float
  published: bool = False
  settled: bool = False
  shared: dict[str, Any] | None = None

  @property
  def leader(self) -> bool:
    """Whether this process chooses (process 0)."""
    return self.process == 0

  def remaining_ms(self) -> int:
    """Milliseconds left to wait (at least one second, so a late step still asks once)."""
    return int(max(self.deadline - time.monotonic(), 1.0) * 1000)


def begin(program: str, signature: Any, settings: dict[str, Any]) -> Agreement | None:
  """Starts a build's agreement: None in a single-process run (nothing to agree on).

  Args:
    program: the traced program's text (``str`` of its ClosedJaxpr).
    signature: the arguments' signature the build is kept under.
    settings: what the choice is made from besides the program (``Settings.key``).

  Returns:
    The :class:`Agreement`, registered with :func:`reports_failures` so that an error
    later in the build reaches the other processes.

  Raises:
    RuntimeError: several processes but no ``jax.distributed`` client to agree through.
  """
  process, processes = _process()
  if processes <= 1:
    return None
  client = _client()
  if client is None:
    raise RuntimeError(
      f"overlap: this job has {processes} processes but no jax.distributed client, through "
      "which process 0 shares its choice of variant: call jax.distributed.initialize() "
      "before building the step"
    )
  fingerprint = selection_cache.key(program, signature, settings)
  if fingerprint is None:  # settings that are not JSON: the same hash, by repr
    text = repr(sorted(settings.items())) + repr(signature) + program
    fingerprint = hashlib.sha256(_ADDRESS.sub("", text).encode()).hexdigest()[:32]
  with _lock:
    n = _builds[fingerprint]
    _builds[fingerprint] += 1
  wait = timeout_s()
  agreement = Agreement(
    f"{PREFIX}{fingerprint}/{n}",
    process,
    processes,
    time.monotonic() + wait,
    wait,
  )
  stack = getattr(_open, "stack", None)
  if stack is not None:
    stack.append(agreement)
  return agreement


def follows(agreement: Agreement | None) -> bool:
  """Whether this process takes process 0's choice instead of choosing (and so reads
  neither its selection cache nor compiles the variants)."""
  return agreement is not None and not agreement.leader


def _wait(agreement: Agreement, what: str, get):
  try:
    return get(agreement.remaining_ms())
  except Exception as e:  # noqa: BLE001 - the runtime raises its own error types
    first = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    raise RuntimeError(
      f"overlap: process {agreement.process} of {agreement.processes} waited "
      f"{agreement.timeout_s:g} s for {what} (key {agreement.key}) and gave up: {first}. "
      "Process 0 may still be compiling the variants (raise $"
      f"{TIMEOUT_ENV}), may have stopped, or may have built a different program or "
      f"settings ({_published_hint()}); every process must build each step, in the same "
      "order"
    ) from e


def _published_hint() -> str:
  try:
    keys = [k for k, _ in _client().key_value_dir_get(PREFIX)]
  except Exception:  # noqa: BLE001 - only a hint for the error message
    return "the choices it published could not be listed"
  builds = sorted({k[len(PREFIX) :].split("/ack/")[0] for k in keys if "/ack/" not in k})
  if not builds:
    return "it has published no choice yet"
  return "builds it published: " + ", ".join(builds[-5:])


def receive(agreement: Agreement, candidates: list[Candidate], fallback=None) -> Choice | None:
  """Process 0's choice among ``candidates`` (a process other than 0; waits for it).

  The chosen variant is found in ``candidates`` by name (added to them, as the selection
  cache's :func:`~.variants.recall` does, when it is a variant scheduled from a latency
  profile: the profile's text is written to this host's cache directory).

  Args:
    agreement: this build's agreement (``follows(agreement)``).
    candidates: this process's variants.
    fallback: the configuration of a chosen variant not in ``candidates`` (a GSPMD step's
      compiler-option variants, all the step as written), except its shard_map form's.

  Returns:
    The shared :class:`~.records.Choice` (``how="shared"``, ``origin="process 0"``), or
    None where process 0 had no choice to make (a single variant, the same as this
    process's only one).

  Raises:
    RuntimeError: no choice came within the timeout, process 0 reported an error, or its
      variant is not among this process's (the message names both).
  """
  raw = _wait(
    agreement,
    "process 0's choice of variant",
    lambda ms: _client().blocking_key_value_get(agreement.key, ms),
  )
  shared = json.loads(raw)
  agreement.shared = shared
  if shared.get("error"):
    raise RuntimeError(
      f"overlap: process 0 could not choose a variant for this step, so process "
      f"{agreement.process} stops too: {shared['error']}"
    )
  names = [c.name for c in candidates]
  chosen, base = shared["chosen"], shared["base"]
  if not shared["estimates"]:  # process 0 had a single variant
    if names == [chosen]:
      return None
  if base in names:
    cfg = candidates[names.index(base)].config
  elif fallback is not None and not base.startswith(CONVERTED_PREFIX):
    cfg = fallback
  else:
    raise RuntimeError(
      f"overlap: process 0 chose the variant {chosen!r}, which process {agreement.process} "
      f"cannot build: its variants are {names} (the processes traced the step differently, "
      "or run different versions of jax or jax_overlap)"
    )
  options = dict(shared["options"])
  if shared.get("profile") is not None:
    options[latency_profile.OPTION] = _write_profile(
      shared["profile"], str(options.get(latency_profile.OPTION, ""))
    )
  candidates = list(candidates)
  if chosen in names:
    i = names.index(chosen)
    candidates[i] = Candidate(chosen, cfg, options)
  else:
    candidates.append(Candidate(chosen, cfg, options))
    i = len(candidates) - 1
  return Choice(
    tuple(candidates),
    i,
    tuple(Estimate(str(n), float(t)) for n, t in shared["estimates"]),
    failed=tuple(str(f) for f in shared["failed"]),
    judged=tuple(str(j) for j in shared["judged"]),
    how="shared",
    origin="process 0",
  )


def _write_profile(text: str, leader_path: str) -> str:
  """Process 0's latency profile written on this host, under the same (content) name."""
  name = os.path.basename(leader_path) or hashlib.sha1(text.encode()).hexdigest()[:16] + ".pbtxt"
  for d in (
    os.path.join(cache.cache_dir(), "latency_profiles"),
    os.path.join(tempfile.gettempdir(), "jax_overlap"),
  ):
    path = os.path.join(d, name)
    try:
      cache.write_text(path, text)
      return path
    except OSError:
      continue
  raise RuntimeError(
    "overlap: process 0's chosen variant is scheduled from a latency profile, which this "
    "process could not write to its cache directory or to a temporary directory"
  )


def _publish(agreement: Agreement, payload: dict[str, Any]) -> None:
  agreement.published = True
  agreement.shared = payload
  # Its own compiles do not count: process 0 now waits as long for the others.
  agreement.deadline = time.monotonic() + agreement.timeout_s
  try:
    text = json.dumps(payload, sort_keys=True)
  except TypeError as e:
    text = json.dumps({"error": f"the chosen variant cannot be shared: {e}"})
  _client().key_value_set(agreement.key, text)


def settle(agreement: Agreement | None, choice: Choice, notes: list[str]) -> None:
  """Ends a build's agreement once the variant is known: process 0 publishes its choice,
  every process confirms (:func:`confirm`), and a note for ``explain()`` says the choice
  was shared and by which process. Nothing in a single-process run (``agreement`` None).

  Raises:
    RuntimeError: another process could not use the choice, or a wait timed out.
  """
  if agreement is None:
    return
  name, options = choice.name, choice.candidate.options
  estimates = [(e.name, e.step_time_s) for e in choice.estimates]
  failed, judged = list(choice.failed), list(choice.judged)
  if agreement.leader:
    profile = None
    path = options.get(latency_profile.OPTION)
    if name.endswith(PROFILED_SUFFIX) and path is not None:
      try:
        with open(str(path)) as f:
          profile = f.read()
      except OSError as e:
        _publish(agreement, {"error": f"its latency profile {path} cannot be read: {e}"})
        raise RuntimeError(
          f"overlap: the chosen variant {name!r} is scheduled from the latency profile "
          f"{path}, which cannot be read to share it with the other processes: {e}"
        ) from e
    _publish(
      agreement,
      {
        "chosen": name,
        "base": name[: -len(PROFILED_SUFFIX)] if name.endswith(PROFILED_SUFFIX) else name,
        "options": options,
        "estimates": [[n, t] for n, t in estimates],
        "failed": list(failed),
        "judged": list(judged),
        "profile": profile,
      },
    )
  confirm(agreement)
  how = (
    "chose it (its selection cache and compiles; the others did not compile the variants)"
    if agreement.leader
    else f"took it as published (this process, {agreement.process}, compiled no variant "
    "and read no selection cache)"
  )
  notes.append(
    f"variant {name!r} shared by process 0 with all {agreement.processes} processes of the "
    f"job (jax.distributed key-value store, key {agreement.key}): process 0 {how}"
  )


def confirm(agreement: Agreement, error: str | None = None) -> None:
  """Meets the other processes once this one has its variant (``error``: why it has none).

  Each process writes its error, if any, then all wait at a barrier, then each reads the
  errors: all of them stop together where one cannot run the choice.

  Raises:
    RuntimeError: a process reported an error, or the barrier timed out.
  """
  agreement.settled = True
  client = _client()
  if error is not None:
    with _suppressed():
      client.key_value_set(
        f"{agreement.key}/ack/{agreement.process}", error[:2000], allow_overwrite=True
      )
  _wait(
    agreement,
    "the other processes to take the same variant",
    lambda ms: client.wait_at_barrier(f"{agreement.key}/confirmed", ms),
  )
  if error is not None:
    return
  try:
    problems = sorted(client.key_value_dir_get(f"{agreement.key}/ack/"))
  except Exception as e:  # noqa: BLE001 - the runtime raises its own error types
    raise RuntimeError(
      f"overlap: process {agreement.process} could not read the other processes' answers "
      f"for key {agreement.key}: {e}"
    ) from e
  if problems:
    key, message = problems[0]
    other = key.rsplit("/", 1)[-1]
    chosen = (agreement.shared or {}).get("chosen")
    mine = f" (process 0 chose {chosen!r})" if chosen else ""
    raise RuntimeError(
      f"overlap: process {other} cannot run the variant this process "
      f"({agreement.process}) built{mine}, so no process runs the step: {message}"
    )


class _suppressed:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return exc[0] is not None and issubclass(exc[0], Exception)


def _fail(agreement: Agreement, e: BaseException) -> None:
  """Tells the other processes that this build failed, so that they stop too."""
  message = f"{type(e).__name__}: {str(e).splitlines()[0][:1000] if str(e) else ''}"
  if agreement.leader and not agreement.published:
    with _suppressed():
      _publish(agreement, {"error": message})
  if not agreement.settled:
    with _suppressed():
      confirm(agreement, f"process {agreement.process}: {message}")


def reports_failures(build):
  """Decorates a step's build: an error raised after :func:`begin` and before
  :func:`settle` is reported to the other processes (process 0's as its published choice,
  any process's at the confirmation), so they stop with it instead of waiting."""

  @functools.wraps(build)
  def wrapper(*args, **kwargs):
    previous = getattr(_open, "stack", None)
    _open.stack = []
    try:
      return build(*args, **kwargs)
    except BaseException as e:
      for agreement in _open.stack:
        _fail(agreement, e)
      raise
    finally:
      _open.stack = previous

  return wrapper
